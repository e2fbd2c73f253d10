//! [`Arg`]s and [`Row`]s on PostgreSQL. Integers bind as `bigint` (every integer column is one),
//! and a NULL binds with no type, so that PostgreSQL infers it from where it goes.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArgumentBuffer, PgArguments, PgRow, PgTypeInfo};
use sqlx::{Column as _, Postgres, Row as _, TypeInfo as _};

use super::{Arg, Row, Value};
use crate::store::StoreError;

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

pub(super) fn bind<'q>(mut query: Query<'q>, args: &[Arg<'q>]) -> Query<'q> {
    for arg in args {
        query = match *arg {
            Arg::Null => query.bind(Untyped),
            Arg::Int(n) => query.bind(n),
            Arg::Text(s) => query.bind(s),
            Arg::Blob(b) => query.bind(b),
        };
    }
    query
}

/// A NULL of no declared type (OID 0: the server infers it).
struct Untyped;

impl sqlx::Type<Postgres> for Untyped {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(0))
    }
}

impl sqlx::Encode<'_, Postgres> for Untyped {
    fn encode_by_ref(&self, _: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        Ok(IsNull::Yes)
    }
}

pub(super) fn row(row: &PgRow) -> Result<Row, StoreError> {
    let mut values = Vec::with_capacity(row.len());
    for (i, column) in row.columns().iter().enumerate() {
        let value = match column.type_info().name() {
            "INT8" => row.try_get::<Option<i64>, _>(i)?.map(Value::Int),
            "INT4" => row
                .try_get::<Option<i32>, _>(i)?
                .map(|n| Value::Int(n.into())),
            "INT2" => row
                .try_get::<Option<i16>, _>(i)?
                .map(|n| Value::Int(n.into())),
            "BOOL" => row
                .try_get::<Option<bool>, _>(i)?
                .map(|b| Value::Int(b.into())),
            "TEXT" | "VARCHAR" | "NAME" => row.try_get::<Option<String>, _>(i)?.map(Value::Text),
            "BYTEA" => row.try_get::<Option<Vec<u8>>, _>(i)?.map(Value::Blob),
            "VOID" => None,
            other => {
                return Err(StoreError::Decode(format!(
                    "column {} has type {other}, which the store does not read",
                    column.name()
                )));
            }
        };
        values.push(value.unwrap_or(Value::Null));
    }
    Ok(Row(values))
}
