//! One way to run SQL on either engine: the handlers write portable SQL with `?N` placeholders
//! and `RETURNING`, bind [`Arg`]s and read [`Row`]s, and never see which engine answers.

use super::StoreError;

mod pg;
use pg::PgSql;

/// A connection (or open transaction) of either engine.
pub struct Sql<'a>(pub(super) Engine<'a>);

pub(super) enum Engine<'a> {
    Sqlite(&'a rusqlite::Connection),
    Postgres(PgSql<'a>),
}

impl std::fmt::Debug for Sql<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Engine::Sqlite(_) => "Sql(sqlite)",
            Engine::Postgres(_) => "Sql(postgres)",
        })
    }
}

impl Sql<'_> {
    /// Runs a statement; the number of rows it changed.
    pub fn execute(&self, sql: &str, args: &[Arg<'_>]) -> Result<u64, StoreError> {
        match &self.0 {
            Engine::Sqlite(conn) => {
                let mut stmt = conn.prepare_cached(sql)?;
                let changed = stmt.execute(rusqlite::params_from_iter(args.iter()))?;
                Ok(changed as u64)
            }
            Engine::Postgres(pg) => pg.execute(sql, args),
        }
    }

    /// Runs an `INSERT … RETURNING id`: the new row's id.
    pub fn insert(&self, sql: &str, args: &[Arg<'_>]) -> Result<i64, StoreError> {
        self.query_opt(sql, args)?
            .ok_or_else(|| StoreError::Decode(format!("no id returned by {sql}")))?
            .get(0)
    }

    /// The first row of a query, if any.
    pub fn query_opt(&self, sql: &str, args: &[Arg<'_>]) -> Result<Option<Row>, StoreError> {
        Ok(self.query(sql, args)?.into_iter().next())
    }

    /// Every row of a query.
    pub fn query(&self, sql: &str, args: &[Arg<'_>]) -> Result<Vec<Row>, StoreError> {
        match &self.0 {
            Engine::Sqlite(conn) => {
                let mut stmt = conn.prepare_cached(sql)?;
                let width = stmt.column_count();
                let rows = stmt.query_map(rusqlite::params_from_iter(args.iter()), |r| {
                    (0..width).map(|i| sqlite_value(r, i)).collect()
                })?;
                Ok(rows
                    .map(|values| values.map(Row))
                    .collect::<Result<_, _>>()?)
            }
            Engine::Postgres(pg) => pg.query(sql, args),
        }
    }
}

fn sqlite_value(row: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<Value> {
    use rusqlite::types::ValueRef;
    Ok(match row.get_ref(i)? {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(n) => Value::Int(n),
        ValueRef::Real(f) => Value::Text(f.to_string()),
        ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => Value::Blob(b.to_vec()),
    })
}

/// A bound parameter (see [`ToArg`] and `args!`).
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    Null,
    Int(i64),
    Text(&'a str),
    Blob(&'a [u8]),
}

impl rusqlite::ToSql for Arg<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Arg::Null => ValueRef::Null,
            Arg::Int(n) => ValueRef::Integer(*n),
            Arg::Text(s) => ValueRef::Text(s.as_bytes()),
            Arg::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

/// Values that bind as an [`Arg`] (by reference: binding never moves a value).
pub trait ToArg {
    fn to_arg(&self) -> Arg<'_>;
}

impl ToArg for i64 {
    fn to_arg(&self) -> Arg<'_> {
        Arg::Int(*self)
    }
}

impl ToArg for str {
    fn to_arg(&self) -> Arg<'_> {
        Arg::Text(self)
    }
}

impl ToArg for String {
    fn to_arg(&self) -> Arg<'_> {
        Arg::Text(self)
    }
}

impl ToArg for [u8] {
    fn to_arg(&self) -> Arg<'_> {
        Arg::Blob(self)
    }
}

impl ToArg for Vec<u8> {
    fn to_arg(&self) -> Arg<'_> {
        Arg::Blob(self)
    }
}

impl<T: ToArg> ToArg for Option<T> {
    fn to_arg(&self) -> Arg<'_> {
        self.as_ref().map_or(Arg::Null, ToArg::to_arg)
    }
}

impl<T: ToArg + ?Sized> ToArg for &T {
    fn to_arg(&self) -> Arg<'_> {
        (**self).to_arg()
    }
}

/// The arguments of a statement, borrowed as `rusqlite::params!` borrows them:
/// `args![a, b]` is `&[a.to_arg(), b.to_arg()]`.
#[macro_export]
macro_rules! args {
    ($($arg:expr),* $(,)?) => {
        &[$($crate::store::ToArg::to_arg(&$arg)),*]
    };
}

/// One column's value as read.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
}

/// One result row.
#[derive(Clone, Debug)]
pub struct Row(pub(super) Vec<Value>);

impl Row {
    /// Column `i` as `T`; a type mismatch is a [`StoreError::Decode`].
    pub fn get<T: FromValue>(&self, i: usize) -> Result<T, StoreError> {
        let value = self
            .0
            .get(i)
            .ok_or_else(|| StoreError::Decode(format!("no column {i}")))?;
        T::from_value(value).ok_or_else(|| {
            StoreError::Decode(format!(
                "column {i} is {value:?}, not {}",
                std::any::type_name::<T>()
            ))
        })
    }
}

/// Types a column can be read as.
pub trait FromValue: Sized {
    fn from_value(value: &Value) -> Option<Self>;
}

impl FromValue for i64 {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Int(n) => Some(*n),
            _ => None,
        }
    }
}

impl FromValue for String {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromValue for Vec<u8> {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Blob(b) => Some(b.clone()),
            _ => None,
        }
    }
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Null => Some(None),
            other => T::from_value(other).map(Some),
        }
    }
}
