-- Where a run's time went: each stage item of a run (download, quantize / evaluate / kl / benchmark per
-- checkpoint, decide) with its start, end, seconds and the engine starts it made. Stages run side by side
-- where the flow allows it (builds and evaluations share a GPU; benchmarks take one lane each), so the
-- seconds of a run's rows add up to more than its wall time; run_timeline has that.
CREATE OR REPLACE VIEW stage_times AS
SELECT st.run_id,
       st.stage,
       CASE WHEN st.item = '' THEN NULL ELSE coalesce(v.name, st.item) END AS checkpoint,
       st.started_at,
       st.completed_at AS ended_at,
       epoch(st.completed_at - st.started_at) AS seconds,
       coalesce(st.engine_starts, 0) AS engine_starts,
       st.detail LIKE 'reused%' AS reused,
       st.item
FROM run_stages st
LEFT JOIN variants v ON v.variant_uid = st.item;

-- One row per run: wall time from the run's start to its end, the seconds of its stages, and its engine starts.
CREATE OR REPLACE VIEW run_timeline AS
SELECT r.run_id,
       r.model_id,
       r.status,
       r.started_at,
       r.finished_at,
       epoch(r.finished_at - r.started_at) AS wall_seconds,
       sum(t.seconds) AS stage_seconds,
       sum(t.engine_starts) AS engine_starts,
       count(t.stage) AS stage_items
FROM runs r
LEFT JOIN stage_times t USING (run_id)
GROUP BY ALL;
