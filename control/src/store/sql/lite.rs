//! [`Arg`]s and [`Row`]s on SQLite: values are read by the type each one has (SQLite types values,
//! not columns).

use sqlx::sqlite::{SqliteArguments, SqliteRow};
use sqlx::{Column as _, Row as _, Sqlite, TypeInfo as _, ValueRef as _};

use super::{Arg, Row, Value};
use crate::store::StoreError;

type Query<'q> = sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>>;

pub(super) fn bind<'q>(mut query: Query<'q>, args: &[Arg<'q>]) -> Query<'q> {
    for arg in args {
        query = match *arg {
            Arg::Null => query.bind(None::<i64>),
            Arg::Int(n) => query.bind(n),
            Arg::Text(s) => query.bind(s),
            Arg::Blob(b) => query.bind(b),
        };
    }
    query
}

pub(super) fn row(row: &SqliteRow) -> Result<Row, StoreError> {
    let mut values = Vec::with_capacity(row.len());
    for (i, column) in row.columns().iter().enumerate() {
        let raw = row.try_get_raw(i)?;
        let value = if raw.is_null() {
            Value::Null
        } else {
            match raw.type_info().name() {
                "INTEGER" | "BOOLEAN" => Value::Int(row.try_get_unchecked(i)?),
                "REAL" => Value::Text(row.try_get_unchecked::<f64, _>(i)?.to_string()),
                "TEXT" => Value::Text(row.try_get_unchecked(i)?),
                "BLOB" => Value::Blob(row.try_get_unchecked(i)?),
                other => {
                    return Err(StoreError::Decode(format!(
                        "column {} has type {other}, which the store does not read",
                        column.name()
                    )));
                }
            }
        };
        values.push(value);
    }
    Ok(Row(values))
}
