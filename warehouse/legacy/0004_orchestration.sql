-- Orchestration: what each successful run evaluated (for the nightly's "inputs changed" check) and the
-- hub releases the watcher has triggered (so a second call triggers nothing twice).

CREATE TABLE run_inputs (
    run_id       VARCHAR PRIMARY KEY,       -- the evaluate-model run
    model_id     VARCHAR NOT NULL,
    inputs_hash  VARCHAR NOT NULL,          -- sha256 of model sha, variant recipes, suite, scenarios, policy, libraries
    inputs       JSON NOT NULL,             -- what was hashed
    recorded_at  TIMESTAMP NOT NULL
);

CREATE TABLE release_triggers (
    model_id      VARCHAR NOT NULL,         -- hub repo id
    sha           VARCHAR NOT NULL,         -- hub commit sha
    source        VARCHAR NOT NULL CHECK (source IN ('hub', 'direct')),
    flow_run_id   VARCHAR,                  -- the evaluate-model run it started
    triggered_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (model_id, sha)
);
