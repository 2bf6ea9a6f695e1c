-- The warehouse as a DuckLake (migration 12, after the DuckDB-file schema's 0001-0011 in warehouse/legacy, so
-- that a Parquet export of any earlier schema still loads as an older one): every table of that schema as 0011
-- left it, without PRIMARY KEY and CHECK constraints, which DuckLake does not enforce (it enforces NOT NULL only).
-- Each table's key is in schema_keys, and the writers in warehouse/store.py keep it: a writer holds the
-- warehouse's write lock (warehouse/lake.py) from its first read to its commit, so
-- "replace the row of this key" and "insert unless this key is there" are atomic across processes and hosts.
-- The enumerations the CHECKs held are kept by the records that write them (quantgate/tasks/records.py).

-- Which columns identify a row of each table: at most one row per key (tests/test_lake_concurrency.py).
CREATE TABLE schema_keys (
    table_name   VARCHAR NOT NULL,
    key_columns  VARCHAR[] NOT NULL
);

CREATE TABLE runs (
    run_id        VARCHAR NOT NULL,         -- the Prefect flow run that started it
    flow_name     VARCHAR NOT NULL,
    model_id      VARCHAR,
    started_at    TIMESTAMP NOT NULL,
    finished_at   TIMESTAMP,
    status        VARCHAR NOT NULL,         -- running, completed, failed
    error         VARCHAR,
    catalog_path  VARCHAR,
    catalog_hash  VARCHAR,
    host          VARCHAR,
    versions      JSON,
    resume_key    VARCHAR                   -- hash of what the run was asked to do (catalog, model spec)
);

CREATE TABLE run_attempts (
    attempt_id   VARCHAR NOT NULL,          -- Prefect flow-run id
    run_id       VARCHAR NOT NULL,          -- the run it started or resumed
    host         VARCHAR,
    pid          INTEGER,
    started_at   TIMESTAMP NOT NULL,
    finished_at  TIMESTAMP,
    status       VARCHAR NOT NULL,          -- running, completed, failed, abandoned
    error        VARCHAR
);

-- A stage's completion mark, written in the same transaction as the stage's rows.
CREATE TABLE run_stages (
    run_id        VARCHAR NOT NULL,
    stage         VARCHAR NOT NULL,         -- download, quantize, evaluate, kl, benchmark, decide
    item          VARCHAR NOT NULL,         -- what it covered: a variant name (quantize), a variant uid, or ''
    detail        VARCHAR,                  -- what it produced: the model uid (download), the variant uid (quantize)
    attempt_id    VARCHAR NOT NULL,         -- the flow run that completed it
    completed_at  TIMESTAMP NOT NULL,
    started_at    TIMESTAMP,
    engine_starts INTEGER
);

CREATE TABLE models (
    model_uid       VARCHAR NOT NULL,       -- model_id@sha[:12]
    model_id        VARCHAR NOT NULL,
    source          VARCHAR NOT NULL,       -- hub, local, gguf
    revision        VARCHAR,
    sha             VARCHAR NOT NULL,       -- hub commit sha, or content hash of a local folder
    path            VARCHAR NOT NULL,
    architecture    VARCHAR,
    num_parameters  BIGINT,
    size_bytes      BIGINT,
    first_run_id    VARCHAR NOT NULL
);

-- One row per distinct build. The base model is the variant with method 'base'. A skipped variant keeps status
-- 'failed' with skipped = true (as in the DuckDB-file schema).
CREATE TABLE variants (
    variant_uid        VARCHAR NOT NULL,    -- hash of model sha + recipe hash + library versions
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
    status             VARCHAR NOT NULL,    -- built, failed
    error              VARCHAR,
    created_run_id     VARCHAR NOT NULL,
    created_at         TIMESTAMP NOT NULL,
    weights            VARCHAR DEFAULT 'real',  -- real, dummy (random weights of a real shape, for speed only)
    skipped            BOOLEAN DEFAULT false
);

-- Which variants a run looked at, whether it built them or reused an earlier build, and whose evaluation and
-- speed rows it uses for them.
CREATE TABLE run_variants (
    run_id             VARCHAR NOT NULL,
    variant_uid        VARCHAR NOT NULL,
    role               VARCHAR NOT NULL,    -- base, variant
    reused             BOOLEAN NOT NULL,
    eval_key           VARCHAR,
    speed_key          VARCHAR,
    speed_run_id       VARCHAR,
    speed_variant_uid  VARCHAR
);

-- Quality is a property of (variant, evaluation config): a rerun with the same config reuses it.
CREATE TABLE quality_evals (
    variant_uid  VARCHAR NOT NULL,
    eval_key     VARCHAR NOT NULL,          -- hash of task configs, limits, lm-eval version
    run_id       VARCHAR NOT NULL,          -- the run that measured it
    evaluator    VARCHAR NOT NULL,
    config       JSON,
    seconds      DOUBLE,
    status       VARCHAR NOT NULL,          -- ok, failed
    error        VARCHAR,
    created_at   TIMESTAMP NOT NULL
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
    higher_is_better  BOOLEAN
);

CREATE TABLE quality_samples (
    variant_uid  VARCHAR NOT NULL,
    eval_key     VARCHAR NOT NULL,
    task         VARCHAR NOT NULL,
    doc_id       INTEGER NOT NULL,
    metric       VARCHAR NOT NULL,
    filter       VARCHAR NOT NULL,
    value        DOUBLE,
    detail       JSON
);

CREATE TABLE speed_results (
    run_id                  VARCHAR NOT NULL,
    variant_uid             VARCHAR NOT NULL,
    engine                  VARCHAR NOT NULL,
    scenario                VARCHAR NOT NULL,
    status                  VARCHAR NOT NULL,   -- ok, skipped, failed
    reason                  VARCHAR,
    config                  JSON,
    device                  VARCHAR,
    num_requests            INTEGER,
    input_tokens            BIGINT,
    output_tokens           BIGINT,
    tokens_per_s            DOUBLE,             -- output tokens / wall second, median over repetitions
    requests_per_s          DOUBLE,
    ttft_ms                 DOUBLE,             -- time to first token
    tpot_ms                 DOUBLE,             -- (E2EL - TTFT) / (output tokens - 1)
    e2el_ms                 DOUBLE,             -- end-to-end latency of a batch
    peak_memory_bytes       BIGINT,
    energy_j_per_token      DOUBLE,
    repetitions             JSON,
    versions                JSON,
    created_at              TIMESTAMP NOT NULL,
    total_tokens_per_s      DOUBLE,             -- (input + output) tokens / wall second
    decode_tokens_per_s     DOUBLE,             -- batch 1: 1000 / tpot_ms
    bandwidth_gbps          DOUBLE,             -- device copy, bytes read + written / s, same process
    weight_bytes_per_token  BIGINT,             -- checkpoint bytes read per decode step
    roofline_fraction       DOUBLE,             -- decode tok/s ÷ (bandwidth ÷ weight bytes)
    nvml_peak_bytes         BIGINT,             -- device memory in use at its highest, minus at start
    torch_peak_bytes        BIGINT,             -- torch allocator peak of the measuring process
    kv_cache_tokens         BIGINT,             -- vLLM KV-cache budget
    kv_cache_bytes          BIGINT,
    details                 JSON
);

CREATE TABLE decisions (
    run_id              VARCHAR NOT NULL,
    variant_uid         VARCHAR NOT NULL,
    decision            VARCHAR NOT NULL,     -- accept, reject, inconclusive
    reason              VARCHAR NOT NULL,
    checks              JSON,                 -- decisions imported from before legacy migration 0009 only
    quality_recovery    DOUBLE,               -- worst recovery over the gated metrics
    speedup             DOUBLE,
    size_ratio          DOUBLE,
    policy_hash         VARCHAR NOT NULL,
    policy              JSON NOT NULL,
    decided_at          TIMESTAMP NOT NULL,
    quality_lower_bound DOUBLE,               -- worst CI lower bound of recovery over the gated metrics
    flip_rate           DOUBLE                -- highest share of items flipped over the gated metrics
);

-- One row per check of a decision, in the decision's order (quality gates in policy order, then speed,
-- serving, size): the deciding check is the first that failed, else the first inconclusive.
CREATE TABLE decision_checks (
    run_id              VARCHAR NOT NULL,
    variant_uid         VARCHAR NOT NULL,
    position            INTEGER NOT NULL,
    kind                VARCHAR NOT NULL,     -- build, quality, speed, serving, size
    name                VARCHAR NOT NULL,     -- e.g. 'qg_piqa/acc', 'speed vllm/gpu-throughput', 'size'
    task                VARCHAR,
    metric              VARCHAR,
    value               DOUBLE,               -- recovery, speedup, goodput ratio or size ratio
    lower               DOUBLE,               -- confidence interval of a recovery
    upper               DOUBLE,
    threshold           DOUBLE,
    outcome             VARCHAR NOT NULL,     -- pass, fail, inconclusive, not_measured
    min_detectable_drop DOUBLE,               -- recovery drop these items resolve at the policy's confidence
    items               INTEGER,
    items_to_decide     BIGINT,               -- inconclusive: items that would decide it, same paired spread
    note                VARCHAR NOT NULL,
    detail              JSON
);

-- One row per load of a serving scenario (a concurrency level or a Poisson request rate).
CREATE TABLE serving_loads (
    run_id            VARCHAR NOT NULL,
    variant_uid       VARCHAR NOT NULL,
    engine            VARCHAR NOT NULL,
    scenario          VARCHAR NOT NULL,
    load              VARCHAR NOT NULL,     -- 'c=8' or 'rate=4'
    max_concurrency   INTEGER,
    request_rate      DOUBLE,               -- requests per second (Poisson arrivals)
    num_prompts       INTEGER NOT NULL,
    duration_s        DOUBLE NOT NULL,      -- first send to last answer
    completed         INTEGER NOT NULL,
    failed            INTEGER NOT NULL,
    output_tokens     BIGINT,
    energy_j          DOUBLE,               -- NVML energy counter over the load, when it moved
    slo_ttft_ms       DOUBLE,
    slo_tpot_ms       DOUBLE,
    slo_e2el_ms       DOUBLE,
    created_at        TIMESTAMP NOT NULL
);

CREATE TABLE serving_requests (
    run_id            VARCHAR NOT NULL,
    variant_uid       VARCHAR NOT NULL,
    engine            VARCHAR NOT NULL,
    scenario          VARCHAR NOT NULL,
    load              VARCHAR NOT NULL,
    request_index     INTEGER NOT NULL,
    success           BOOLEAN NOT NULL,
    error             VARCHAR,
    prompt_tokens     INTEGER,
    output_tokens     INTEGER,
    ttft_ms           DOUBLE,
    tpot_ms           DOUBLE,
    e2el_ms           DOUBLE,
    itl_ms            DOUBLE[],             -- gaps between streamed chunks
    arrival_offset_s  DOUBLE,               -- when it was due, from the start of the load
    start_offset_s    DOUBLE                -- when it was sent (after waiting for a slot)
);

-- What an endpoint said about itself; base_url is stored without user info or query, the API key never.
CREATE TABLE serving_endpoints (
    run_id          VARCHAR NOT NULL,
    variant_uid     VARCHAR NOT NULL,
    engine          VARCHAR NOT NULL,
    scenario        VARCHAR NOT NULL,
    base_url        VARCHAR NOT NULL,
    model           VARCHAR NOT NULL,
    server          VARCHAR,
    server_version  VARCHAR,
    identity        JSON,
    probed_at       TIMESTAMP NOT NULL
);

-- What a gpu-suite run did, step by step, in order: ran, failed, or skipped (and why).
CREATE TABLE suite_steps (
    run_id       VARCHAR NOT NULL,
    step_index   INTEGER NOT NULL,
    part         VARCHAR NOT NULL,
    engine       VARCHAR NOT NULL,
    build        VARCHAR NOT NULL,
    scenarios    VARCHAR[] NOT NULL,
    status       VARCHAR NOT NULL,          -- ok, failed, skipped
    reason       VARCHAR,
    started_s    DOUBLE,                    -- seconds after the run began
    seconds      DOUBLE
);

-- What each successful run evaluated (the nightly's "inputs changed" check).
CREATE TABLE run_inputs (
    run_id       VARCHAR NOT NULL,
    model_id     VARCHAR NOT NULL,
    inputs_hash  VARCHAR NOT NULL,          -- sha256 of model sha, variant recipes, suite, scenarios, policy, libraries
    inputs       JSON NOT NULL,
    recorded_at  TIMESTAMP NOT NULL
);

-- The hub releases the watcher has triggered (so a second call triggers nothing twice).
CREATE TABLE release_triggers (
    model_id      VARCHAR NOT NULL,         -- hub repo id
    sha           VARCHAR NOT NULL,         -- hub commit sha
    source        VARCHAR NOT NULL,         -- hub, direct
    flow_run_id   VARCHAR,
    triggered_at  TIMESTAMP NOT NULL
);

-- US$ per hour of one device, as the catalog gave it when the run started.
CREATE TABLE run_prices (
    run_id        VARCHAR NOT NULL,
    device        VARCHAR NOT NULL,
    usd_per_hour  DOUBLE NOT NULL,
    catalog_hash  VARCHAR,
    recorded_at   TIMESTAMP NOT NULL
);

-- Which version of the views (warehouse/views/*.sql) the warehouse holds, by checksum (one row).
CREATE TABLE schema_views (
    id          INTEGER NOT NULL,
    checksum    VARCHAR NOT NULL,
    applied_at  TIMESTAMP NOT NULL
);

INSERT INTO schema_keys VALUES
    ('schema_keys', ['table_name']),
    ('schema_migrations', ['version']),
    ('schema_views', ['id']),
    ('runs', ['run_id']),
    ('run_attempts', ['attempt_id']),
    ('run_stages', ['run_id', 'stage', 'item']),
    ('models', ['model_uid']),
    ('variants', ['variant_uid']),
    ('run_variants', ['run_id', 'variant_uid']),
    ('quality_evals', ['variant_uid', 'eval_key']),
    ('quality_results', ['variant_uid', 'eval_key', 'task', 'metric', 'filter']),
    ('quality_samples', ['variant_uid', 'eval_key', 'task', 'doc_id', 'metric', 'filter']),
    ('speed_results', ['run_id', 'variant_uid', 'engine', 'scenario']),
    ('decisions', ['run_id', 'variant_uid']),
    ('decision_checks', ['run_id', 'variant_uid', 'position']),
    ('serving_loads', ['run_id', 'variant_uid', 'engine', 'scenario', 'load']),
    ('serving_requests', ['run_id', 'variant_uid', 'engine', 'scenario', 'load', 'request_index']),
    ('serving_endpoints', ['run_id', 'variant_uid', 'engine', 'scenario']),
    ('suite_steps', ['run_id', 'step_index']),
    ('run_inputs', ['run_id']),
    ('release_triggers', ['model_id', 'sha']),
    ('run_prices', ['run_id', 'device']);
