-- The initial schema. Each resource row keeps its wire object as JSON in `data`, beside the
-- columns that carry constraints and lookups; `events` is the watch history (revision order).
CREATE TABLE clusters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    reg_access_id TEXT NOT NULL UNIQUE,
    data TEXT NOT NULL
);
CREATE TABLE workers (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cluster_id INTEGER NOT NULL REFERENCES clusters(id),
    name TEXT NOT NULL,
    token_access_id TEXT UNIQUE,
    token_digest BLOB,
    data TEXT NOT NULL,
    UNIQUE (cluster_id, name)
);
CREATE TABLE models (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    cluster_id INTEGER REFERENCES clusters(id),
    data TEXT NOT NULL
);
CREATE TABLE model_instances (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model_id INTEGER NOT NULL REFERENCES models(id),
    worker_id INTEGER REFERENCES workers(id),
    data TEXT NOT NULL
);
CREATE INDEX model_instances_model ON model_instances(model_id);
CREATE INDEX model_instances_worker ON model_instances(worker_id);
CREATE TABLE api_keys (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    access_id TEXT NOT NULL UNIQUE,
    digest BLOB NOT NULL,
    data TEXT NOT NULL,
    credential TEXT NOT NULL
);
-- AUTOINCREMENT: the next revision, never one that was used before.
CREATE TABLE events (
    revision INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    type INTEGER NOT NULL,
    object_id INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX events_kind ON events(kind, revision);
