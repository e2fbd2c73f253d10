//! Portable SQL on one PostgreSQL connection or transaction (tokio-postgres, driven from the
//! store's blocking threads): `?N` placeholders to `$N`, [`Arg`]s as parameters, rows as [`Row`]s.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use bytes::BytesMut;
use tokio::runtime::Handle;
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use tokio_postgres::{Client, Statement};

use super::{Arg, Engine, Row, Sql, Value};
use crate::store::StoreError;

impl<'a> Sql<'a> {
    /// Statements on a connection outside a transaction.
    pub(in crate::store) fn on_client(
        client: &'a Client,
        statements: &'a mut HashMap<String, Statement>,
        rt: &'a Handle,
    ) -> Self {
        Sql(Engine::Postgres(PgSql {
            on: On::Client(client),
            statements: RefCell::new(statements),
            rt,
        }))
    }

    /// Statements in an open transaction.
    pub(in crate::store) fn in_transaction(
        tx: &'a tokio_postgres::Transaction<'a>,
        statements: &'a mut HashMap<String, Statement>,
        rt: &'a Handle,
    ) -> Self {
        Sql(Engine::Postgres(PgSql {
            on: On::Tx(tx),
            statements: RefCell::new(statements),
            rt,
        }))
    }
}

enum On<'a> {
    Client(&'a Client),
    Tx(&'a tokio_postgres::Transaction<'a>),
}

/// SQL on one PostgreSQL connection, from a blocking thread.
pub(crate) struct PgSql<'a> {
    on: On<'a>,
    statements: RefCell<&'a mut HashMap<String, Statement>>,
    rt: &'a Handle,
}

impl PgSql<'_> {
    fn prepare(&self, sql: &str) -> Result<Statement, StoreError> {
        let mut cache = self.statements.borrow_mut();
        if let Some(stmt) = cache.get(sql) {
            return Ok(stmt.clone());
        }
        let text = placeholders(sql);
        let stmt = match &self.on {
            On::Client(c) => self.rt.block_on(c.prepare(&text))?,
            On::Tx(t) => self.rt.block_on(t.prepare(&text))?,
        };
        cache.insert(sql.to_owned(), stmt.clone());
        Ok(stmt)
    }

    pub(in crate::store) fn execute(&self, sql: &str, args: &[Arg<'_>]) -> Result<u64, StoreError> {
        let stmt = self.prepare(sql)?;
        let params: Vec<&(dyn ToSql + Sync)> = args.iter().map(|a| a as _).collect();
        // The command tag's count: rows changed, or rows returned by a SELECT run for its effect
        // (advisory locks, pg_notify).
        Ok(match &self.on {
            On::Client(c) => self.rt.block_on(c.execute(&stmt, &params))?,
            On::Tx(t) => self.rt.block_on(t.execute(&stmt, &params))?,
        })
    }

    pub(in crate::store) fn query(
        &self,
        sql: &str,
        args: &[Arg<'_>],
    ) -> Result<Vec<Row>, StoreError> {
        let stmt = self.prepare(sql)?;
        let params: Vec<&(dyn ToSql + Sync)> = args.iter().map(|a| a as _).collect();
        let rows = match &self.on {
            On::Client(c) => self.rt.block_on(c.query(&stmt, &params))?,
            On::Tx(t) => self.rt.block_on(t.query(&stmt, &params))?,
        };
        rows.iter().map(pg_row).collect()
    }
}

/// `?N` (SQLite's numbered placeholders) to `$N`. Our SQL has no `?` anywhere else.
fn placeholders(sql: &str) -> String {
    sql.replace('?', "$")
}

fn pg_row(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
    let mut values = Vec::with_capacity(row.len());
    for (i, column) in row.columns().iter().enumerate() {
        let ty = column.type_();
        let value = if *ty == Type::INT8 {
            row.try_get::<_, Option<i64>>(i)?.map(Value::Int)
        } else if *ty == Type::INT4 {
            row.try_get::<_, Option<i32>>(i)?
                .map(|n| Value::Int(n.into()))
        } else if *ty == Type::INT2 {
            row.try_get::<_, Option<i16>>(i)?
                .map(|n| Value::Int(n.into()))
        } else if *ty == Type::BOOL {
            row.try_get::<_, Option<bool>>(i)?
                .map(|b| Value::Int(b.into()))
        } else if *ty == Type::TEXT || *ty == Type::VARCHAR || *ty == Type::NAME {
            row.try_get::<_, Option<String>>(i)?.map(Value::Text)
        } else if *ty == Type::BYTEA {
            row.try_get::<_, Option<Vec<u8>>>(i)?.map(Value::Blob)
        } else if *ty == Type::VOID {
            Some(Value::Null)
        } else {
            return Err(StoreError::Decode(format!(
                "column {} has type {ty}, which the store does not read",
                column.name()
            )));
        };
        values.push(value.unwrap_or(Value::Null));
    }
    Ok(Row(values))
}

impl ToSql for Arg<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Arg::Null => Ok(IsNull::Yes),
            // Integers are written at the width the statement expects.
            Arg::Int(n) if *ty == Type::INT4 => i32::try_from(*n)?.to_sql(ty, out),
            Arg::Int(n) if *ty == Type::INT2 => i16::try_from(*n)?.to_sql(ty, out),
            Arg::Int(n) => n.to_sql(ty, out),
            Arg::Text(s) => s.to_sql(ty, out),
            Arg::Blob(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError::Postgres(Arc::new(e))
    }
}
