//! The issues reported for a document: every problem, with its line and column when known.

use std::fmt;

use serde::Serialize;

use super::locate::Locator;
use super::validate::{Problem, Target};

/// All problems found in a worker configuration document.
#[derive(Clone, Debug, PartialEq, Serialize, thiserror::Error)]
pub struct ConfigErrors {
    pub issues: Vec<ConfigIssue>,
}

/// One problem in a worker configuration document.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConfigIssue {
    /// Dotted path of the offending key (`"system_reserved.ram"`); `""` for the whole document.
    pub key: String,
    /// What is wrong, in words an operator can act on.
    pub message: String,
    /// 1-based line in the YAML text, when known (never for JSON input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    /// 1-based column in the YAML text, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<usize>,
}

impl fmt::Display for ConfigErrors {
    /// One line naming every key: `invalid worker configuration: worker_port: ...; foo: ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("invalid worker configuration: ")?;
        for (i, issue) in self.issues.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            if issue.key.is_empty() {
                f.write_str("(document)")?;
            } else {
                write!(f, "{}", issue.key.escape_debug())?;
            }
            write!(f, ": {}", issue.message)?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    /// A single document-level issue.
    fn document(message: String, line: Option<usize>, column: Option<usize>) -> ConfigErrors {
        ConfigErrors {
            issues: vec![ConfigIssue {
                key: String::new(),
                message: one_line(&message),
                line,
                column,
            }],
        }
    }

    /// A YAML syntax error at the parser's position. libyaml reports errors at the end of input
    /// one line past the last one; such positions are moved to the end of the last line so that
    /// they always lie inside the text.
    pub(super) fn from_yaml_error(error: &serde_yaml_ng::Error, text: &str) -> ConfigErrors {
        let position = error
            .location()
            .map(|l| clamp_to_text(text, l.line(), l.column()));
        ConfigErrors::document(
            format!("invalid YAML: {error}"),
            position.map(|p| p.0),
            position.map(|p| p.1),
        )
    }

    pub(super) fn from_problems(problems: Vec<Problem>, locator: Option<&Locator>) -> ConfigErrors {
        let issues = problems
            .into_iter()
            .map(|problem| {
                let position =
                    locator.and_then(|l| l.locate(&problem.path, problem.at == Target::Value));
                ConfigIssue {
                    key: problem.path.join("."),
                    message: one_line(&problem.message),
                    line: position.map(|p| p.0),
                    column: position.map(|p| p.1),
                }
            })
            .collect();
        ConfigErrors { issues }
    }
}

/// `(line, column)` limited to the lines of `text` (split at `\n`; 1-based).
fn clamp_to_text(text: &str, line: usize, column: usize) -> (usize, usize) {
    let last_line = text.split('\n').count();
    if line <= last_line {
        return (line.max(1), column.max(1));
    }
    let last_len = text.rsplit('\n').next().map_or(0, |l| l.chars().count());
    (last_line, last_len + 1)
}

/// Keeps messages (which may quote library errors) on one line for logs and the summary.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
