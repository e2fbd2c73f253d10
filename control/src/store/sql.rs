//! One way to run SQL on either engine: the handlers write portable SQL with `$N` placeholders
//! (both engines read them) and `RETURNING`, bind [`Arg`]s and read [`Row`]s, and never see which
//! engine answers. Statements are prepared once per connection (sqlx's statement cache).

use sqlx::pool::PoolConnection;
use sqlx::{Database, Postgres, Sqlite, Transaction};

use super::StoreError;

mod lite;
mod pg;

/// A pooled connection, or an open transaction, of either engine. Dropping a transaction rolls
/// it back.
pub struct Sql(pub(super) Conn);

pub(super) enum Conn {
    Sqlite(Held<Sqlite>),
    Postgres(Held<Postgres>),
}

pub(super) enum Held<DB: Database> {
    Pooled(PoolConnection<DB>),
    Tx(Transaction<'static, DB>),
}

impl<DB: Database> Held<DB> {
    fn conn(&mut self) -> &mut DB::Connection {
        match self {
            Held::Pooled(c) => c,
            Held::Tx(t) => t,
        }
    }

    async fn end(self, commit: bool) -> Result<(), sqlx::Error> {
        match self {
            Held::Pooled(_) => Ok(()),
            Held::Tx(t) if commit => t.commit().await,
            Held::Tx(t) => t.rollback().await,
        }
    }
}

impl std::fmt::Debug for Sql {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Conn::Sqlite(_) => "Sql(sqlite)",
            Conn::Postgres(_) => "Sql(postgres)",
        })
    }
}

impl Sql {
    /// Runs a statement; the number of rows it changed (or returned, for a `SELECT` run for its
    /// effect).
    pub async fn execute(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<u64, StoreError> {
        let done = match &mut self.0 {
            Conn::Sqlite(c) => lite::bind(sqlx::query(sql), args)
                .execute(c.conn())
                .await?
                .rows_affected(),
            Conn::Postgres(c) => pg::bind(sqlx::query(sql), args)
                .execute(c.conn())
                .await?
                .rows_affected(),
        };
        Ok(done)
    }

    /// Runs an `INSERT … RETURNING id`: the new row's id.
    pub async fn insert(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<i64, StoreError> {
        self.query_opt(sql, args)
            .await?
            .ok_or_else(|| StoreError::Decode(format!("no id returned by {sql}")))?
            .get(0)
    }

    /// The first row of a query, if any.
    pub async fn query_opt(
        &mut self,
        sql: &str,
        args: &[Arg<'_>],
    ) -> Result<Option<Row>, StoreError> {
        Ok(self.query(sql, args).await?.into_iter().next())
    }

    /// Every row of a query.
    pub async fn query(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<Vec<Row>, StoreError> {
        match &mut self.0 {
            Conn::Sqlite(c) => {
                let rows = lite::bind(sqlx::query(sql), args)
                    .fetch_all(c.conn())
                    .await?;
                rows.iter().map(lite::row).collect()
            }
            Conn::Postgres(c) => {
                let rows = pg::bind(sqlx::query(sql), args).fetch_all(c.conn()).await?;
                rows.iter().map(pg::row).collect()
            }
        }
    }

    /// Runs several statements at once, without arguments (migrations).
    pub(super) async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        match &mut self.0 {
            Conn::Sqlite(c) => {
                sqlx::raw_sql(sql).execute(c.conn()).await?;
            }
            Conn::Postgres(c) => {
                sqlx::raw_sql(sql).execute(c.conn()).await?;
            }
        }
        Ok(())
    }

    /// Commits the transaction (a pooled connection has nothing to commit).
    pub(super) async fn commit(self) -> Result<(), StoreError> {
        match self.0 {
            Conn::Sqlite(h) => h.end(true).await?,
            Conn::Postgres(h) => h.end(true).await?,
        }
        Ok(())
    }

    /// Rolls the transaction back now, rather than when its connection is next used.
    pub(super) async fn rollback(self) -> Result<(), StoreError> {
        match self.0 {
            Conn::Sqlite(h) => h.end(false).await?,
            Conn::Postgres(h) => h.end(false).await?,
        }
        Ok(())
    }
}

/// A bound parameter (see [`ToArg`] and `args!`).
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    Null,
    Int(i64),
    Text(&'a str),
    Blob(&'a [u8]),
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

/// The arguments of a statement, borrowed (binding never moves a value):
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
