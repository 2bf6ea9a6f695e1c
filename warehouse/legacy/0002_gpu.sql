-- GPU benchmarking: dummy-weight variants, roofline and memory columns on speed results, per-request
-- serving results with their loads, and the steps of a gpu-suite run.

-- 'real' or 'dummy' (random weights of a real shape, for speed only; never evaluated or decided).
-- DuckDB cannot add a column with constraints; VariantArtifact.weights admits only those two values.
ALTER TABLE variants ADD COLUMN weights VARCHAR DEFAULT 'real';

ALTER TABLE speed_results ADD COLUMN total_tokens_per_s DOUBLE;      -- (input + output) tokens / wall second
ALTER TABLE speed_results ADD COLUMN decode_tokens_per_s DOUBLE;     -- batch 1: 1000 / tpot_ms
ALTER TABLE speed_results ADD COLUMN bandwidth_gbps DOUBLE;          -- device copy, bytes read + written / s, same process
ALTER TABLE speed_results ADD COLUMN weight_bytes_per_token BIGINT;  -- checkpoint bytes read per decode step
ALTER TABLE speed_results ADD COLUMN roofline_fraction DOUBLE;       -- decode tok/s ÷ (bandwidth ÷ weight bytes)
ALTER TABLE speed_results ADD COLUMN nvml_peak_bytes BIGINT;         -- device memory in use at its highest, minus at start
ALTER TABLE speed_results ADD COLUMN torch_peak_bytes BIGINT;        -- torch allocator peak of the measuring process
ALTER TABLE speed_results ADD COLUMN kv_cache_tokens BIGINT;         -- vLLM KV-cache budget
ALTER TABLE speed_results ADD COLUMN kv_cache_bytes BIGINT;
ALTER TABLE speed_results ADD COLUMN details JSON;

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
    created_at        TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, variant_uid, engine, scenario, load)
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
    start_offset_s    DOUBLE,               -- when it was sent (after waiting for a slot)
    PRIMARY KEY (run_id, variant_uid, engine, scenario, load, request_index)
);

-- What a gpu-suite run did, step by step, in order: ran, failed, or skipped (and why).
CREATE TABLE suite_steps (
    run_id       VARCHAR NOT NULL,
    step_index   INTEGER NOT NULL,
    part         VARCHAR NOT NULL,
    engine       VARCHAR NOT NULL,
    build        VARCHAR NOT NULL,
    scenarios    VARCHAR[] NOT NULL,
    status       VARCHAR NOT NULL CHECK (status IN ('ok', 'failed', 'skipped')),
    reason       VARCHAR,
    started_s    DOUBLE,                    -- seconds after the run began
    seconds      DOUBLE,
    PRIMARY KEY (run_id, step_index)
);
