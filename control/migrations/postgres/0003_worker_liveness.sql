-- A worker's state and last heartbeat as columns beside its JSON, so that the heartbeat monitor
-- expires silent workers with one UPDATE. `heartbeat_at` is in Unix milliseconds; workers that
-- were ready get a full timeout from now (the JSON's time is not parsed here).
ALTER TABLE workers ADD COLUMN state TEXT NOT NULL DEFAULT 'not_ready';
ALTER TABLE workers ADD COLUMN heartbeat_at BIGINT;
UPDATE workers SET state = coalesce(data::jsonb ->> 'state', 'not_ready');
UPDATE workers SET heartbeat_at = (extract(epoch FROM now()) * 1000)::bigint
    WHERE state = 'ready';
CREATE INDEX workers_liveness ON workers(state, heartbeat_at);
