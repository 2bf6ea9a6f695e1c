-- Crash safety. A stage's completion mark is written in the same transaction as the stage's rows, and
-- every Prefect flow run that worked on a run is an attempt: a rerun of an unfinished run (same model,
-- same resume_key) adopts it and skips the stages already marked complete.
CREATE TABLE run_stages (
    run_id        VARCHAR NOT NULL,
    stage         VARCHAR NOT NULL,         -- download, quantize, evaluate, kl, benchmark, decide
    item          VARCHAR NOT NULL,         -- what it covered: a variant name (quantize), a variant uid, or ''
    detail        VARCHAR,                  -- what it produced: the model uid (download), the variant uid (quantize)
    attempt_id    VARCHAR NOT NULL,         -- the flow run that completed it
    completed_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, stage, item)
);

CREATE TABLE run_attempts (
    attempt_id   VARCHAR PRIMARY KEY,       -- Prefect flow-run id
    run_id       VARCHAR NOT NULL,          -- the run it started or resumed
    host         VARCHAR,
    pid          INTEGER,
    started_at   TIMESTAMP NOT NULL,
    finished_at  TIMESTAMP,
    status       VARCHAR NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'abandoned')),
    error        VARCHAR
);

ALTER TABLE runs ADD COLUMN resume_key VARCHAR;  -- hash of what the run was asked to do (catalog, model spec)
