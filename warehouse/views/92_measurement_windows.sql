-- Each speed measurement's time with the GPU alone (details.measured_from / measured_to, written by the process
-- that measured), how long it waited for it (and its engine's start for GPU memory), and what of its run overlapped
-- it: stage items whose time is not measured (quantize, evaluate, kl) and other measurements. On one GPU, engines
-- start beside the builds and evaluations and measure alone (tasks/launch.GpuClock): both counts are 0 on every row.
CREATE OR REPLACE VIEW measurement_windows AS
WITH w AS (
    SELECT s.run_id, s.variant_uid, v.name AS checkpoint, s.engine, s.scenario, s.status,
           CAST(s.details ->> 'measured_from' AS TIMESTAMP) AS measured_from,
           CAST(s.details ->> 'measured_to' AS TIMESTAMP) AS measured_to,
           CAST(s.details ->> 'gpu_wait_s' AS DOUBLE) AS waited_s,
           coalesce(CAST(s.details ->> 'memory_wait_s' AS DOUBLE), 0) AS memory_wait_s,
           s.details ->> 'compile_cache' AS compile_cache
    FROM speed_results s
    LEFT JOIN variants v USING (variant_uid)
    WHERE s.details ->> 'measured_from' IS NOT NULL
)
SELECT w.*,
       epoch(w.measured_to - w.measured_from) AS seconds,
       (SELECT count(*) FROM run_stages st
        WHERE st.run_id = w.run_id AND st.stage IN ('quantize', 'evaluate', 'kl')
          AND st.started_at < w.measured_to AND st.completed_at > w.measured_from) AS overlapping_work,
       (SELECT count(*) FROM w o
        WHERE o.run_id = w.run_id AND (o.variant_uid, o.engine, o.scenario) <> (w.variant_uid, w.engine, w.scenario)
          AND o.measured_from < w.measured_to AND o.measured_to > w.measured_from) AS overlapping_measurements
FROM w;
