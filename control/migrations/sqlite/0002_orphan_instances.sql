-- An instance may have no model (an orphan: its model was deleted while its worker was away).
-- SQLite cannot drop a NOT NULL: the table is rebuilt, ids and sequence kept.
CREATE TABLE model_instances_new (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model_id INTEGER REFERENCES models(id),
    worker_id INTEGER REFERENCES workers(id),
    data TEXT NOT NULL
);
INSERT INTO model_instances_new (id, model_id, worker_id, data)
    SELECT id, model_id, worker_id, data FROM model_instances;
DELETE FROM sqlite_sequence WHERE name = 'model_instances_new';
INSERT INTO sqlite_sequence (name, seq)
    SELECT 'model_instances_new', seq FROM sqlite_sequence WHERE name = 'model_instances';
DROP TABLE model_instances;
ALTER TABLE model_instances_new RENAME TO model_instances;
CREATE INDEX model_instances_model ON model_instances(model_id);
CREATE INDEX model_instances_worker ON model_instances(worker_id);
