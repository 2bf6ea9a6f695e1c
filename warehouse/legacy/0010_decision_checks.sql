-- A decision may be inconclusive: a quality check whose confidence interval spans its threshold says
-- neither pass nor fail. DuckDB cannot change a CHECK constraint, so decisions is rebuilt with the third
-- value and every row copied (its JSON `checks` column stays, for the rows written before this migration).
ALTER TABLE decisions RENAME TO decisions_0008;
CREATE TABLE decisions (
    run_id              VARCHAR NOT NULL,
    variant_uid         VARCHAR NOT NULL,
    decision            VARCHAR NOT NULL CHECK (decision IN ('accept', 'reject', 'inconclusive')),
    reason              VARCHAR NOT NULL,
    checks              JSON,                 -- before migration 0009 only; since then, decision_checks
    quality_recovery    DOUBLE,               -- worst recovery over the gated metrics
    speedup             DOUBLE,
    size_ratio          DOUBLE,
    policy_hash         VARCHAR NOT NULL,
    policy              JSON NOT NULL,
    decided_at          TIMESTAMP NOT NULL,
    quality_lower_bound DOUBLE,
    flip_rate           DOUBLE,
    PRIMARY KEY (run_id, variant_uid)
);
INSERT INTO decisions BY NAME SELECT * FROM decisions_0008;
DROP TABLE decisions_0008;

-- One row per check of a decision, in the decision's order (quality gates in policy order, then speed,
-- serving, size): the deciding check is the first that failed, else the first inconclusive.
CREATE TABLE decision_checks (
    run_id              VARCHAR NOT NULL,
    variant_uid         VARCHAR NOT NULL,
    position            INTEGER NOT NULL,
    kind                VARCHAR NOT NULL CHECK (kind IN ('build', 'quality', 'speed', 'serving', 'size')),
    name                VARCHAR NOT NULL,     -- e.g. 'qg_piqa/acc', 'speed vllm/gpu-throughput', 'size'
    task                VARCHAR,
    metric              VARCHAR,
    value               DOUBLE,               -- recovery, speedup, goodput ratio or size ratio
    lower               DOUBLE,               -- confidence interval of a recovery
    upper               DOUBLE,
    threshold           DOUBLE,
    outcome             VARCHAR NOT NULL CHECK (outcome IN ('pass', 'fail', 'inconclusive', 'not_measured')),
    min_detectable_drop DOUBLE,               -- recovery drop these items resolve at the policy's confidence
    items               INTEGER,
    items_to_decide     BIGINT,               -- inconclusive: items that would decide it, same paired spread
    note                VARCHAR NOT NULL,
    detail              JSON,
    PRIMARY KEY (run_id, variant_uid, position)
);
