-- Issue 7: the price table each run used (cost per million tokens keeps the prices of its day), and the
-- server behind each OpenAI-compatible endpoint run.

-- US$ per hour of one device, as the catalog (or GPU suite file) gave it when the run started. A speed row's
-- device name matches the longest key it starts with ("NVIDIA H200", "cpu" for "cpu: <model> (n cores)").
CREATE TABLE run_prices (
    run_id        VARCHAR NOT NULL,
    device        VARCHAR NOT NULL,
    usd_per_hour  DOUBLE NOT NULL,
    catalog_hash  VARCHAR,                  -- hash of the file the table came from
    recorded_at   TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, device)
);

-- What an endpoint said about itself: name and version where it exposes them (/version, /api/version,
-- /info, /v1/models owned_by, the `server` response header, the stream's model and system_fingerprint).
-- base_url is stored without user info or query; the API key is never stored.
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
    probed_at       TIMESTAMP NOT NULL,
    PRIMARY KEY (run_id, variant_uid, engine, scenario)
);
