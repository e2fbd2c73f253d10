//! A throwaway PostgreSQL cluster per test: code that stores state in PostgreSQL is tested
//! against the real server (its locking, transactions and crash recovery), not a mock. The
//! server binaries must be installed (`apt-get install postgresql`, or `FADEN_PG_BIN`); a test
//! that needs them fails rather than skips when they are missing.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

/// The database [`Postgres::start`] creates and [`Postgres::url`] names.
const DATABASE: &str = "faden";

/// Server settings for tests: durability off (a lost cluster is recreated, never recovered from
/// a power cut), and enough connections for pools of several servers at once.
const SERVER_SETTINGS: &str = "-c listen_addresses=127.0.0.1 -c fsync=off \
     -c synchronous_commit=off -c full_page_writes=off -c max_connections=300";

/// Polls (once a second) for the test process to disappear, then stops the server and removes
/// its directory: a test killed with SIGKILL never runs `Drop`. Arguments: pid, directory, the
/// stop command.
const WATCHDOG: &str = r#"pid=$1 root=$2
shift 2
while kill -0 "$pid" 2>/dev/null; do sleep 1; done
"$@" >/dev/null 2>&1
rm -rf "$root""#;

/// Which step of setting up or driving a cluster failed, with the tool's output.
#[derive(Debug)]
pub struct PostgresError {
    step: String,
    detail: String,
}

impl PostgresError {
    fn new(step: impl Into<String>, detail: impl fmt::Display) -> Self {
        Self {
            step: step.into(),
            detail: detail.to_string(),
        }
    }
}

impl fmt::Display for PostgresError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PostgreSQL test cluster: {}: {}", self.step, self.detail)
    }
}

impl std::error::Error for PostgresError {}

/// A private PostgreSQL cluster on 127.0.0.1 and a free port, dropped with the value.
#[derive(Debug)]
pub struct Postgres {
    /// Holds `data/` (the cluster) and `run/` (unix socket and server log).
    root: PathBuf,
    port: u16,
    /// Superuser created by initdb and named in URLs.
    user: String,
    /// Run the server tools as user `postgres` (it refuses to run as root).
    as_postgres: bool,
    pg_ctl: PathBuf,
    watchdog: Option<Child>,
}

impl Postgres {
    /// Starts a cluster with one database `faden` (trust auth).
    pub fn start() -> Result<Postgres, PostgresError> {
        let initdb = pg_bin("initdb")?;
        let postgres = pg_bin("postgres")?;
        let pg_ctl = pg_bin("pg_ctl")?;
        let as_postgres = effective_uid()? == 0;
        let user = if as_postgres {
            "root".to_owned()
        } else {
            current_user()?
        };

        let root = tempfile::Builder::new()
            .prefix("faden-pg-")
            .tempdir()
            .map_err(|e| PostgresError::new("create temp dir", e))?
            .keep();
        // From here on `Drop` cleans up whatever exists, on any error below.
        let mut pg = Postgres {
            root,
            port: 0,
            user,
            as_postgres,
            pg_ctl,
            watchdog: None,
        };
        pg.prepare_dirs()?;
        pg.watchdog = Some(pg.spawn_watchdog()?);

        let data = pg.data_dir();
        pg.run(
            "initdb",
            Command::new(&initdb)
                .arg("-D")
                .arg(&data)
                .args(["-U", &pg.user, "-A", "trust", "-E", "UTF8", "--no-sync"])
                // The C locale exists everywhere; initdb fails on an uninstalled $LANG.
                .arg("--locale=C"),
            None,
        )?;
        // Before the first start, single-user mode needs no client tools.
        let out = pg.run(
            "create database (single-user mode)",
            Command::new(&postgres)
                .arg("--single")
                .arg("-D")
                .arg(&data)
                .arg("postgres"),
            Some(&format!("CREATE DATABASE \"{DATABASE}\";\n")),
        )?;
        // Single-user mode exits 0 after a failed statement.
        if String::from_utf8_lossy(&out.stderr).contains("ERROR:") {
            return Err(PostgresError::new(
                "create database (single-user mode)",
                output_text(&out),
            ));
        }

        // A free port can be taken by a concurrent test before the server binds it: retry.
        let mut last = None;
        for _ in 0..5 {
            pg.port = crate::free_port();
            match pg.pg_ctl_start() {
                Ok(()) => return Ok(pg),
                Err(e) if e.detail.contains("could not bind") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| PostgresError::new("pg_ctl start", "no attempt made")))
    }

    /// `postgres://<user>@127.0.0.1:<port>/faden?sslmode=disable` (no password).
    pub fn url(&self) -> String {
        self.database_url(DATABASE)
    }

    /// The TCP port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Creates database `name` on this cluster with `createdb` (or `psql`, if `createdb` is
    /// missing) and returns its URL, in the form of [`Self::url`]. `name` is limited to ASCII
    /// letters, digits, `_` and `-`, so that it needs no quoting in the URL.
    pub fn create_database(&self, name: &str) -> Result<String, PostgresError> {
        let step = format!("create database {name:?}");
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(PostgresError::new(
                step,
                "name must be ASCII letters, digits, '_' or '-'",
            ));
        }
        let port = self.port.to_string();
        let conn = ["-h", "127.0.0.1", "-p", &port, "-U", &self.user];
        let mut cmd = match pg_bin("createdb") {
            Ok(createdb) => {
                let mut cmd = Command::new(createdb);
                cmd.args(conn).arg("--").arg(name);
                cmd
            }
            Err(createdb_missing) => {
                let psql = pg_bin("psql").map_err(|psql_missing| {
                    PostgresError::new(&step, format!("{createdb_missing}; {psql_missing}"))
                })?;
                let mut cmd = Command::new(psql);
                cmd.args(conn)
                    .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c"])
                    .arg(format!("CREATE DATABASE \"{name}\""));
                cmd
            }
        };
        // Client tools connect over TCP as any OS user; PG* variables of the caller must not
        // redirect them.
        cmd.env("PGSSLMODE", "disable")
            .env_remove("PGSERVICE")
            .env_remove("PGOPTIONS")
            .current_dir(&self.root);
        run_command(&step, &mut cmd, None)?;
        Ok(self.database_url(name))
    }

    /// Immediate stop (like a crash) and start again on the same port and data directory, for
    /// restart tests.
    pub fn restart(&mut self) -> Result<(), PostgresError> {
        self.pg_ctl_stop("immediate")?;
        self.pg_ctl_start()
    }

    fn database_url(&self, database: &str) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{database}?sslmode=disable",
            self.user, self.port
        )
    }

    fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    fn run_dir(&self) -> PathBuf {
        self.root.join("run")
    }

    fn log_path(&self) -> PathBuf {
        self.run_dir().join("postgres.log")
    }

    /// `data/` and `run/`, owned by the user the server runs as; the root stays traversable.
    fn prepare_dirs(&self) -> Result<(), PostgresError> {
        let step = "prepare directories";
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| PostgresError::new(step, format!("{}: {e}", self.root.display())))?;
        let owner = if self.as_postgres {
            Some(passwd_ids("postgres")?)
        } else {
            None
        };
        for dir in [self.data_dir(), self.run_dir()] {
            std::fs::create_dir(&dir)
                .and_then(|()| std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o700)))
                .and_then(|()| match owner {
                    Some((uid, gid)) => std::os::unix::fs::chown(&dir, Some(uid), Some(gid)),
                    None => Ok(()),
                })
                .map_err(|e| PostgresError::new(step, format!("{}: {e}", dir.display())))?;
        }
        Ok(())
    }

    /// The command line, as argv, that stops the server even when this process is gone.
    fn stop_argv(&self, mode: &str) -> Vec<String> {
        let mut argv = Vec::new();
        if self.as_postgres {
            argv.extend(["runuser", "-u", "postgres", "--"].map(str::to_owned));
        }
        argv.push(self.pg_ctl.display().to_string());
        argv.extend(["-D".to_owned(), self.data_dir().display().to_string()]);
        argv.extend(["-m", mode, "-w", "-t", "30", "stop"].map(str::to_owned));
        argv
    }

    fn spawn_watchdog(&self) -> Result<Child, PostgresError> {
        // In its own session, so that a signal to the test's process group or terminal leaves
        // it alive to clean up. `setsid` does not fork here: our child is no group leader.
        let mut cmd = match find_in_path("setsid") {
            Some(setsid) => {
                let mut cmd = Command::new(setsid);
                cmd.arg("sh");
                cmd
            }
            None => {
                let mut cmd = Command::new("sh");
                std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
                cmd
            }
        };
        cmd.arg("-c")
            .arg(WATCHDOG)
            .arg("faden-pg-watchdog")
            .arg(std::process::id().to_string())
            .arg(&self.root)
            .args(self.stop_argv("immediate"))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| PostgresError::new("spawn watchdog", e))
    }

    fn pg_ctl_start(&self) -> Result<(), PostgresError> {
        let opts = format!(
            "-p {} -k {} {SERVER_SETTINGS}",
            self.port,
            self.run_dir().display()
        );
        let result = self.run(
            "pg_ctl start",
            Command::new(&self.pg_ctl)
                .arg("-D")
                .arg(self.data_dir())
                .arg("-l")
                .arg(self.log_path())
                .args(["-o", &opts, "-w", "-t", "60", "start"]),
            None,
        );
        result.map(drop).map_err(|e| {
            PostgresError::new(
                e.step,
                format!(
                    "{}\n--- tail of {} ---\n{}",
                    e.detail,
                    self.log_path().display(),
                    log_tail(&self.log_path(), 40)
                ),
            )
        })
    }

    fn pg_ctl_stop(&self, mode: &str) -> Result<(), PostgresError> {
        let argv = self.stop_argv(mode);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]).current_dir(&self.root);
        run_command(&format!("pg_ctl stop -m {mode}"), &mut cmd, None).map(drop)
    }

    /// Runs a server tool, as user `postgres` when we are root.
    fn run(
        &self,
        step: &str,
        cmd: &mut Command,
        stdin: Option<&str>,
    ) -> Result<Output, PostgresError> {
        // A tool run as `postgres` may not be allowed into the caller's working directory.
        cmd.current_dir(&self.root);
        if !self.as_postgres {
            return run_command(step, cmd, stdin);
        }
        let mut wrapped = Command::new("runuser");
        wrapped
            .args(["-u", "postgres", "--"])
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .current_dir(&self.root);
        run_command(step, &mut wrapped, stdin)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // The watchdog first, so that it cannot race the removal below.
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        if self.data_dir().join("postmaster.pid").exists() {
            let _ = self.pg_ctl_stop("immediate");
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Runs `cmd` to completion with `stdin` as its input; a non-zero exit is an error carrying
/// its output.
fn run_command(
    step: &str,
    cmd: &mut Command,
    stdin: Option<&str>,
) -> Result<Output, PostgresError> {
    let shown = format!("{cmd:?}");
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| PostgresError::new(step, format!("spawn {shown}: {e}")))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // Small input: fits the pipe buffer, so writing before reading cannot deadlock.
        pipe.write_all(input.as_bytes())
            .map_err(|e| PostgresError::new(step, format!("write stdin of {shown}: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| PostgresError::new(step, format!("wait for {shown}: {e}")))?;
    if !out.status.success() {
        return Err(PostgresError::new(
            step,
            format!("{shown} failed ({}):\n{}", out.status, output_text(&out)),
        ));
    }
    Ok(out)
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(log) => {
            let all: Vec<&str> = log.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(unreadable: {e})"),
    }
}

/// A PostgreSQL binary: `$FADEN_PG_BIN`, `/usr/local/bin`, `/usr/lib/postgresql/*/bin` (highest
/// version first), then `$PATH`.
fn pg_bin(name: &str) -> Result<PathBuf, PostgresError> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("FADEN_PG_BIN")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    dirs.push(PathBuf::from("/usr/local/bin"));
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, e.path().join("bin")))
        })
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(v.0));
    dirs.extend(versions.into_iter().map(|(_, bin)| bin));
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .or_else(|| find_in_path(name))
        .ok_or_else(|| {
            PostgresError::new(
                format!("find {name}"),
                format!(
                    "PostgreSQL binary {name} not found in $FADEN_PG_BIN, /usr/local/bin, \
                     /usr/lib/postgresql/*/bin or $PATH (apt-get install postgresql, or set \
                     FADEN_PG_BIN to its bin directory)"
                ),
            )
        })
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The effective uid, from `/proc/self/status` (`Uid:` real, effective, saved, fs), else `id -u`.
fn effective_uid() -> Result<u32, PostgresError> {
    let from_proc = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        });
    if let Some(uid) = from_proc {
        return Ok(uid);
    }
    let out = run_command("find effective uid", Command::new("id").arg("-u"), None)?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| PostgresError::new("find effective uid", format!("`id -u`: {e}")))
}

/// Our user name for the cluster's superuser: `$USER`, else our uid's entry in `/etc/passwd`.
fn current_user() -> Result<String, PostgresError> {
    if let Some(user) = std::env::var("USER").ok().filter(|u| !u.is_empty()) {
        return Ok(user);
    }
    let uid = effective_uid()?.to_string();
    read_passwd()?
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == uid)
        .map(|f| f[0].to_owned())
        .ok_or_else(|| {
            PostgresError::new("find user name", format!("uid {uid} not in /etc/passwd"))
        })
}

/// Uid and gid of `user` from `/etc/passwd`.
fn passwd_ids(user: &str) -> Result<(u32, u32), PostgresError> {
    read_passwd()?
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() > 3 && f[0] == user)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .ok_or_else(|| {
            PostgresError::new(
                format!("find user {user}"),
                format!(
                    "no user {user} in /etc/passwd: running as root, the server needs it \
                     (apt-get install postgresql creates it)"
                ),
            )
        })
}

fn read_passwd() -> Result<String, PostgresError> {
    std::fs::read_to_string("/etc/passwd").map_err(|e| PostgresError::new("read /etc/passwd", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PSQL: &str = "/usr/bin/psql";

    fn select_1(url: &str) {
        if !Path::new(PSQL).exists() {
            return;
        }
        let out = run_command(
            "psql",
            Command::new(PSQL).args([url, "-tAc", "SELECT 1"]),
            None,
        )
        .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1");
    }

    #[test]
    fn start_query_restart_drop() {
        let mut pg = Postgres::start().unwrap();
        let root = pg.root.clone();
        assert!(pg.url().starts_with("postgres://"));
        assert!(
            pg.url()
                .contains(&format!("@127.0.0.1:{}/faden?", pg.port()))
        );
        select_1(&pg.url());

        let port = pg.port();
        pg.restart().unwrap();
        assert_eq!(pg.port(), port);
        select_1(&pg.url());

        let other = pg.create_database("second-db").unwrap();
        assert!(other.contains("/second-db?"));
        select_1(&other);

        drop(pg);
        assert!(!root.exists(), "{} left behind", root.display());
    }

    #[test]
    fn clusters_side_by_side() {
        let a = Postgres::start().unwrap();
        let b = Postgres::start().unwrap();
        assert_ne!(a.port(), b.port());
        select_1(&a.url());
        select_1(&b.url());
    }

    #[test]
    fn invalid_database_name_is_refused() {
        let pg = Postgres::start().unwrap();
        let err = pg.create_database("a\"b").unwrap_err();
        assert!(err.to_string().contains("ASCII"), "{err}");
    }
}
