-- Core tables. Raw, append-only facts written by tasks; views in warehouse/views derive the rest.

CREATE TABLE runs (
    run_id        VARCHAR PRIMARY KEY,      -- Prefect flow-run id
    flow_name     VARCHAR NOT NULL,
    model_id      VARCHAR,
    started_at    TIMESTAMP NOT NULL,
    finished_at   TIMESTAMP,
    status        VARCHAR NOT NULL CHECK (status IN ('running', 'completed', 'failed')),
    error         VARCHAR,
    catalog_path  VARCHAR,
    catalog_hash  VARCHAR,
    host          VARCHAR,
    versions      JSON
);

CREATE TABLE models (
    model_uid       VARCHAR PRIMARY KEY,    -- model_id@sha[:12]
    model_id        VARCHAR NOT NULL,
    source          VARCHAR NOT NULL CHECK (source IN ('hub', 'local', 'gguf')),
    revision        VARCHAR,
    sha             VARCHAR NOT NULL,       -- hub commit sha, or content hash of a local folder
    path            VARCHAR NOT NULL,
    architecture    VARCHAR,
    num_parameters  BIGINT,
    size_bytes      BIGINT,
    first_run_id    VARCHAR NOT NULL
);

-- One row per distinct build. The base model is the variant with method 'base'.
CREATE TABLE variants (
    variant_uid        VARCHAR PRIMARY KEY, -- hash of model sha + recipe hash + library versions
    model_uid          VARCHAR NOT NULL,
    name               VARCHAR NOT NULL,
    method             VARCHAR NOT NULL,
    scheme             VARCHAR,
    bits               INTEGER,
    group_size         INTEGER,
    path               VARCHAR,
    recipe             VARCHAR,
    recipe_hash        VARCHAR,
    lib_versions       JSON,
    size_bytes         BIGINT,
    build_seconds      DOUBLE,
    peak_memory_bytes  BIGINT,
    status             VARCHAR NOT NULL CHECK (status IN ('built', 'failed')),
    error              VARCHAR,
    created_run_id     VARCHAR NOT NULL,
    created_at         TIMESTAMP NOT NULL
);

-- Which variants a run looked at, and whether it built them or reused an earlier build.
CREATE TABLE run_variants (
    run_id       VARCHAR NOT NULL,
    variant_uid  VARCHAR NOT NULL,
    role         VARCHAR NOT NULL CHECK (role IN ('base', 'variant')),
    reused       BOOLEAN NOT NULL,
    eval_key     VARCHAR,                   -- the evaluation this run used for the variant
    PRIMARY KEY (run_id, variant_uid)
);

-- Quality is a property of (variant, evaluation config): a rerun with the same config reuses it.
CREATE TABLE quality_evals (
    variant_uid  VARCHAR NOT NULL,
    eval_key     VARCHAR NOT NULL,          -- hash of task configs, limits, lm-eval version
    run_id       VARCHAR NOT NULL,          -- the run that measured it
    evaluator    VARCHAR NOT NULL,
    config       JSON,
    seconds      DOUBLE,
    status       VARCHAR NOT NULL CHECK (status IN ('ok', 'failed')),
    error        VARCHAR,
    created_at   TIMESTAMP NOT NULL,
    PRIMARY KEY (variant_uid, eval_key)
);

CREATE TABLE quality_results (
    variant_uid       VARCHAR NOT NULL,
    eval_key          VARCHAR NOT NULL,
    run_id            VARCHAR NOT NULL,
    task              VARCHAR NOT NULL,
    metric            VARCHAR NOT NULL,
    filter            VARCHAR NOT NULL,
    value             DOUBLE,
    stderr            DOUBLE,
    n_samples         INTEGER,
    task_version      VARCHAR,
    higher_is_better  BOOLEAN,
    PRIMARY KEY (variant_uid, eval_key, task, metric, filter)
);

CREATE TABLE quality_samples (
    variant_uid  VARCHAR NOT NULL,
    eval_key     VARCHAR NOT NULL,
    task         VARCHAR NOT NULL,
    doc_id       INTEGER NOT NULL,
    metric       VARCHAR NOT NULL,
    filter       VARCHAR NOT NULL,
    value        DOUBLE,
    detail       JSON,
    PRIMARY KEY (variant_uid, eval_key, task, doc_id, metric, filter)
);

CREATE TABLE speed_results (
    run_id              VARCHAR NOT NULL,
    variant_uid         VARCHAR NOT NULL,
    engine              VARCHAR NOT NULL,
    scenario            VARCHAR NOT NULL,
    status              VARCHAR NOT NULL CHECK (status IN ('ok', 'skipped', 'failed')),
    reason              VARCHAR,
    config              JSON,
    device              VARCHAR,
    num_requests        INTEGER,
    input_tokens        BIGINT,
    output_tokens       BIGINT,
    tokens_per_s        DOUBLE,             -- output tokens / wall second, median over repetitions
    requests_per_s      DOUBLE,
    ttft_ms             DOUBLE,             -- time to first token
    tpot_ms             DOUBLE,             -- (E2EL - TTFT) / (output tokens - 1)
    e2el_ms             DOUBLE,             -- end-to-end latency of a batch
    peak_memory_bytes   BIGINT,
    energy_j_per_token  DOUBLE,
    repetitions         JSON,
    versions            JSON,
    created_at          TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, variant_uid, engine, scenario)
);

CREATE TABLE decisions (
    run_id            VARCHAR NOT NULL,
    variant_uid       VARCHAR NOT NULL,
    decision          VARCHAR NOT NULL CHECK (decision IN ('accept', 'reject')),
    reason            VARCHAR NOT NULL,
    checks            JSON,
    quality_recovery  DOUBLE,               -- worst recovery over the gated metrics
    speedup           DOUBLE,
    size_ratio        DOUBLE,
    policy_hash       VARCHAR NOT NULL,
    policy            JSON NOT NULL,
    decided_at        TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, variant_uid)
);
