//! "Did you mean" suggestions for unknown keys.

/// The known key closest to `key`, if it is a plausible typo (edit distance at most 2 after
/// folding case and `-` to `_`).
pub(super) fn closest_known<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    let folded: String = key
        .chars()
        .take(64)
        .map(|c| {
            if c == '-' {
                '_'
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect();
    known
        .iter()
        .map(|candidate| (edit_distance(&folded, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= 2 && *distance < candidate.len())
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// Levenshtein distance over chars (inputs are short: keys are capped at 64 chars above).
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = Vec::with_capacity(b.len() + 1);
        current.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != *cb);
            let delete = previous[j + 1] + 1;
            let insert = current[j] + 1;
            current.push(substitute.min(delete).min(insert));
        }
        previous = current;
    }
    previous[b.len()]
}
