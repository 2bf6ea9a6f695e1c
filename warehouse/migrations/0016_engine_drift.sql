-- The engine-drift sentinel (issue 45, item 3): what each run's probe of its base (the first items of each gated
-- task, measured anew every run and stored as a side evaluation of the base, eval_key 'probe:<probe key>:<run>')
-- showed against the model's previous run's probe of the same checkpoint and probe key: one row per (task, metric,
-- filter) the two probes share. ratio is current ÷ previous (inverted where lower is better, as a recovery is),
-- lower/upper its paired bootstrap interval at `confidence`; moved: the interval excludes 1 and the move is
-- material; drifted: moved while recorded library versions changed (`changed`: 'name a → b, ...').
CREATE TABLE engine_drift (
    run_id            VARCHAR NOT NULL,
    variant_uid       VARCHAR NOT NULL,     -- the base
    previous_run_id   VARCHAR NOT NULL,
    task              VARCHAR NOT NULL,
    metric            VARCHAR NOT NULL,
    filter            VARCHAR NOT NULL,
    items             INTEGER NOT NULL,
    higher_is_better  BOOLEAN,
    previous_value    DOUBLE,
    value             DOUBLE,
    ratio             DOUBLE,
    lower             DOUBLE,
    upper             DOUBLE,
    confidence        DOUBLE,
    moved             BOOLEAN NOT NULL,
    drifted           BOOLEAN NOT NULL,
    changed           VARCHAR NOT NULL,
    recorded_at       TIMESTAMP NOT NULL
);

INSERT INTO schema_keys VALUES ('engine_drift', ['run_id', 'task', 'metric', 'filter']);
