-- Staging: the speed rows, serving loads and requests each run uses. A run's own rows, plus, for a variant
-- whose speed the run took from elsewhere, those rows under the run's id and the variant's uid: an earlier
-- run's (run_variants.speed_run_id: it measured the same scenarios with the same libraries on the same device),
-- or another checkpoint's of the same format (speed_variant_uid). Every view reads speed through these, so a
-- rerun that changes nothing has a full scorecard without a second copy of the rows.
CREATE OR REPLACE VIEW stg_speed_reuse AS
SELECT run_id, variant_uid, speed_run_id, coalesce(speed_variant_uid, variant_uid) AS speed_variant_uid
FROM run_variants
WHERE speed_run_id IS NOT NULL
  AND (speed_run_id <> run_id OR coalesce(speed_variant_uid, variant_uid) <> variant_uid);

CREATE OR REPLACE VIEW stg_speed_results AS
SELECT * FROM speed_results
UNION ALL BY NAME
SELECT s.* REPLACE (u.run_id AS run_id, u.variant_uid AS variant_uid)
FROM stg_speed_reuse u JOIN speed_results s ON s.run_id = u.speed_run_id AND s.variant_uid = u.speed_variant_uid;

-- The speed rows with, per measured pass, its output tokens/s and the CPU seconds the rest of the machine and the
-- hypervisor took meanwhile (tasks/telemetry.PassClocks), as lists (NULL for a row without passes, e.g. serving;
-- NULL entries for a pass of before those readings).
CREATE OR REPLACE VIEW stg_speed_passes AS
SELECT *, json_extract(repetitions, '$[*].tokens_per_s')::DOUBLE[] AS pass_tps,
       json_extract(repetitions, '$[*].other_cpu_s')::DOUBLE[] AS pass_other_cpu_s,
       json_extract(repetitions, '$[*].steal_s')::DOUBLE[] AS pass_steal_s
FROM stg_speed_results;

CREATE OR REPLACE VIEW stg_serving_loads AS
SELECT * FROM serving_loads
UNION ALL BY NAME
SELECT l.* REPLACE (u.run_id AS run_id, u.variant_uid AS variant_uid)
FROM stg_speed_reuse u JOIN serving_loads l ON l.run_id = u.speed_run_id AND l.variant_uid = u.speed_variant_uid;

CREATE OR REPLACE VIEW stg_serving_requests AS
SELECT * FROM serving_requests
UNION ALL BY NAME
SELECT r.* REPLACE (u.run_id AS run_id, u.variant_uid AS variant_uid)
FROM stg_speed_reuse u JOIN serving_requests r ON r.run_id = u.speed_run_id AND r.variant_uid = u.speed_variant_uid;
