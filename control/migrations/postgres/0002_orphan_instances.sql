-- An instance may have no model (an orphan: its model was deleted while its worker was away).
ALTER TABLE model_instances ALTER COLUMN model_id DROP NOT NULL;
