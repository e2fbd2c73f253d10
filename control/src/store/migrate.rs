//! Schema migrations: numbered SQL files under `control/migrations/<engine>/`, compiled in and
//! applied in order, each in one transaction with the schema version it reaches. The version is
//! SQLite's `user_version` or PostgreSQL's `faden_schema` row; a database newer than this faden
//! is refused.

use super::StoreError;

/// One migration file.
#[derive(Debug)]
pub(super) struct Migration {
    /// The file's name without its number and extension.
    pub name: &'static str,
    pub sql: &'static str,
}

macro_rules! migrations {
    ($engine:literal: $($file:literal),* $(,)?) => {
        &[$(Migration {
            name: $file,
            sql: include_str!(concat!("../../migrations/", $engine, "/", $file, ".sql")),
        }),*]
    };
}

/// SQLite's migrations, the n-th reaching schema version n.
pub(super) const SQLITE: &[Migration] =
    migrations!("sqlite": "0001_initial", "0002_orphan_instances", "0003_worker_liveness");

/// PostgreSQL's migrations, the n-th reaching schema version n.
pub(super) const POSTGRES: &[Migration] =
    migrations!("postgres": "0001_initial", "0002_orphan_instances", "0003_worker_liveness");

/// The migrations a database at schema `version` still needs, with the version each reaches.
pub(super) fn pending(
    version: i64,
    migrations: &'static [Migration],
) -> Result<impl Iterator<Item = (i64, &'static Migration)>, StoreError> {
    let applied = usize::try_from(version).unwrap_or(0);
    if applied > migrations.len() {
        return Err(StoreError::Open(format!(
            "the database has schema version {applied}, newer than this faden ({}); upgrade faden",
            migrations.len()
        )));
    }
    Ok((applied..migrations.len()).map(move |i| ((i + 1) as i64, &migrations[i])))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Every file of an engine's folder is in its list, in the order of the files' numbers, and
    /// the numbers run 1, 2, 3…: a file added to the folder but not to the list fails here.
    #[test]
    fn the_lists_match_the_folders() {
        for (engine, list) in [("sqlite", SQLITE), ("postgres", POSTGRES)] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations")
                .join(engine);
            let mut files: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            files.sort();
            let listed: Vec<String> = list.iter().map(|m| format!("{}.sql", m.name)).collect();
            assert_eq!(files, listed, "{engine}");
            for (i, file) in files.iter().enumerate() {
                assert!(
                    file.starts_with(&format!("{:04}_", i + 1)),
                    "{engine}: {file}"
                );
            }
        }
    }

    #[test]
    fn a_newer_database_is_refused() {
        assert_eq!(pending(0, SQLITE).unwrap().count(), SQLITE.len());
        assert_eq!(pending(SQLITE.len() as i64, SQLITE).unwrap().count(), 0);
        assert!(pending(SQLITE.len() as i64 + 1, SQLITE).is_err());
    }
}
