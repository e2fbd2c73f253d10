//! Positions of keys and values in YAML text.

use std::collections::HashMap;

/// Finds the line and column of keys in block-style YAML text.
///
/// `serde_yaml_ng::Value` keeps no source positions, so after a successful parse this scans the
/// text itself. It understands block mappings (plain, single- and double-quoted keys) nested by
/// indentation, which is how these documents are written; for flow style (`{ram: -1}`) it falls
/// back to the nearest enclosing key it can find, and otherwise reports no position. A wrong guess
/// can only cost precision of the position, never correctness of the validation.
pub(super) struct Locator {
    lines: Vec<KeyLine>,
    /// First line index of each top-level key.
    root: HashMap<String, usize>,
}

/// A content line (not blank, not a comment, not a `---` marker or directive).
#[derive(Debug)]
struct KeyLine {
    /// 1-based line number.
    line: usize,
    /// Leading spaces.
    indent: usize,
    /// The mapping key the line starts with, if any.
    key: Option<String>,
    /// 1-based column where the value starts, when it is on the same line.
    value_column: Option<usize>,
}

impl Locator {
    pub(super) fn new(text: &str) -> Locator {
        let lines: Vec<KeyLine> = text
            .lines()
            .enumerate()
            .filter_map(|(i, line)| scan_line(i + 1, line))
            .collect();
        let mut root = HashMap::new();
        if let Some(root_indent) = lines.first().map(|l| l.indent) {
            for (index, line) in lines.iter().enumerate() {
                if let (true, Some(key)) = (line.indent == root_indent, &line.key) {
                    root.entry(key.clone()).or_insert(index);
                }
            }
        }
        Locator { lines, root }
    }

    /// `(line, column)` of the value at `path` (when `want_value` and it is on the key's line) or
    /// of its key; of the deepest enclosing key found when the full path is not.
    pub(super) fn locate(&self, path: &[String], want_value: bool) -> Option<(usize, usize)> {
        let (first, rest) = path.split_first()?;
        let mut index = *self.root.get(first)?;
        let mut complete = true;
        for segment in rest {
            match self.child(index, segment) {
                Some(child) => index = child,
                None => {
                    complete = false;
                    break;
                }
            }
        }
        let found = self.lines.get(index)?;
        let column = match (complete && want_value, found.value_column) {
            (true, Some(value_column)) => value_column,
            _ => found.indent + 1,
        };
        Some((found.line, column))
    }

    /// Index of the line holding `key` directly inside the block that starts after `parent`.
    fn child(&self, parent: usize, key: &str) -> Option<usize> {
        let parent_indent = self.lines.get(parent)?.indent;
        let block = self
            .lines
            .iter()
            .enumerate()
            .skip(parent + 1)
            .take_while(|(_, l)| l.indent > parent_indent);
        let mut child_indent = None;
        for (index, line) in block {
            let indent = *child_indent.get_or_insert(line.indent);
            if line.indent == indent && line.key.as_deref() == Some(key) {
                return Some(index);
            }
        }
        None
    }
}

/// Classifies one line of text; `None` for lines that hold no content.
fn scan_line(number: usize, raw: &str) -> Option<KeyLine> {
    let raw = raw.strip_prefix('\u{feff}').unwrap_or(raw);
    let body = raw.trim_start_matches(' ');
    let indent = raw.len() - body.len();
    let is_marker = indent == 0
        && (body.starts_with("---") || body.starts_with("...") || body.starts_with('%'));
    if body.trim().is_empty() || body.starts_with('#') || is_marker {
        return None;
    }
    let (key, value_column) = match split_key(body) {
        Some((key, consumed)) => {
            let after = &body[consumed..];
            let value = after.trim_start_matches([' ', '\t']);
            let column = (!value.is_empty() && !value.starts_with('#')).then(|| {
                indent + body[..consumed].chars().count() + (after.len() - value.len()) + 1
            });
            (Some(key), column)
        }
        None => (None, None),
    };
    Some(KeyLine {
        line: number,
        indent,
        key,
        value_column,
    })
}

/// Splits `key: value` at the key's colon: the key text and the byte length up to and including
/// the colon.
fn split_key(body: &str) -> Option<(String, usize)> {
    let (key, after_key) = match body.chars().next()? {
        '"' => quoted_key(body, '"')?,
        '\'' => quoted_key(body, '\'')?,
        c if "{[#&*!|>%@`".contains(c) => {
            // Flow collections, anchors, tags, block scalars, reserved indicators: not a plain
            // `key:` line.
            return None;
        }
        '-' | '?' if ends_key(&body[1..]) => {
            // A sequence entry (`- x`) or a complex key (`? x`).
            return None;
        }
        _ => {
            let colon = colon_position(body)?;
            let key = body[..colon].trim_end();
            if key.is_empty() || key.contains(" #") {
                return None;
            }
            return Some((key.to_owned(), colon + 1));
        }
    };
    let rest = &body[after_key..];
    let spaces = rest.len() - rest.trim_start_matches([' ', '\t']).len();
    let colon = after_key + spaces;
    if body[colon..].starts_with(':') && ends_key(&body[colon + 1..]) {
        Some((key, colon + 1))
    } else {
        None
    }
}

/// Byte index of the first `:` that ends a plain key (followed by a space, a tab or the end).
fn colon_position(body: &str) -> Option<usize> {
    body.char_indices()
        .find(|(i, c)| *c == ':' && ends_key(&body[i + 1..]))
        .map(|(i, _)| i)
}

fn ends_key(after_colon: &str) -> bool {
    after_colon.is_empty() || after_colon.starts_with([' ', '\t'])
}

/// A quoted key starting at `body[0]`: its unescaped text and the byte index after the closing
/// quote. Only the escapes that can appear in option names are decoded.
fn quoted_key(body: &str, quote: char) -> Option<(String, usize)> {
    let mut key = String::new();
    let mut chars = body.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        match (quote, c) {
            ('"', '\\') => key.push(chars.next()?.1),
            ('\'', '\'') if chars.peek().map(|(_, n)| *n) == Some('\'') => {
                chars.next();
                key.push('\'');
            }
            (q, c) if c == q => return Some((key, i + c.len_utf8())),
            (_, c) => key.push(c),
        }
    }
    None
}
