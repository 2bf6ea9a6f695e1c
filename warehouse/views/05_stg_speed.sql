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
-- NULL entries for a pass of before those readings). pass_busiest_share: the share of a pass's wall time its
-- busiest process was on a CPU (this process, or the engine's other processes together: vLLM's engine core).
-- paired_base_tps: on a variant's row, the base's passes that alternated with its own in one engine process, in the
-- same order (tasks/steps/benchmark._measure_one; NULL where its passes ran alone).
CREATE OR REPLACE VIEW stg_speed_pass_lists AS
SELECT *, json_extract(repetitions, '$[*].tokens_per_s')::DOUBLE[] AS pass_tps,
       nullif(json_extract(details, '$.paired_base[*].tokens_per_s')::DOUBLE[], []) AS paired_base_tps,
       json_extract(repetitions, '$[*].other_cpu_s')::DOUBLE[] AS pass_other_cpu_s,
       json_extract(repetitions, '$[*].steal_s')::DOUBLE[] AS pass_steal_s,
       list_transform(list_zip(json_extract(repetitions, '$[*].cpu_s')::DOUBLE[],
                               json_extract(repetitions, '$[*].front_cpu_s')::DOUBLE[],
                               json_extract(repetitions, '$[*].wall_s')::DOUBLE[]),
                      lambda p: greatest(p[2], p[1] - p[2]) / nullif(p[3], 0)) AS pass_busiest_share
FROM stg_speed_results;

-- Whether the host paced a row's passes: its busiest process was on a CPU for at least 90% of the median pass, and
-- a decode step took at least 3x the checkpoint's memory floor (its weights' bytes per token over the bandwidth
-- its latency scenario measured, in the same run). Either alone says little: a CUDA wait spins a CPU as busy as a
-- Python loop does, and a batch's step reads more than the weights. Then the engine's Python, not the GPU, set
-- the pace, and a ratio of two such rows moves with the host (reference4-9). NULL where a reading is missing.
CREATE OR REPLACE VIEW stg_speed_passes AS
WITH floors AS (
    SELECT run_id, variant_uid, 1e3 * max(weight_bytes_per_token) / (1e9 * max(bandwidth_gbps)) AS memory_floor_ms
    FROM stg_speed_results
    WHERE status = 'ok' AND weight_bytes_per_token > 0 AND bandwidth_gbps > 0
    GROUP BY ALL
)
SELECT p.*, list_median(p.pass_busiest_share) AS host_busy_share, f.memory_floor_ms,
       list_median(p.pass_busiest_share) >= 0.9 AND p.tpot_ms >= 3 * f.memory_floor_ms AS host_bound
FROM stg_speed_pass_lists p
LEFT JOIN floors f ON f.run_id = p.run_id AND f.variant_uid = p.variant_uid;

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
