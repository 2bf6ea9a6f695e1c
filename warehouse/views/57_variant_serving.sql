-- Serving goodput at the SLO per variant and serving scenario, against the base in the same run: the
-- evidence of the policy's serving gate. A scenario with a sweep counts its tuned serving config
-- (stg_serving_ranked's pick, as in tuned_serving_config), for the variant and for the base alike. host_bound:
-- the variant's or the base's vLLM engine was host-bound in the run's offline or latency passes (stg_speed_passes):
-- a server's goodput is paced by the same engine core, so its ratio moves with the host too.
CREATE OR REPLACE VIEW variant_serving AS
WITH best AS (SELECT * FROM stg_serving_ranked WHERE k = 1),
paced AS (
    SELECT run_id, variant_uid, bool_or(host_bound) AS host_bound
    FROM stg_speed_passes WHERE engine = 'vllm' AND status = 'ok'
    GROUP BY ALL
)
SELECT v.run_id, v.variant_uid, v.engine, v.scenario, v.status, v.reason, v.point, v.settings, v.load,
       v.goodput_requests_per_s, v.output_tokens_per_s, v.points, v.points_ok,
       b.goodput_requests_per_s AS base_goodput_requests_per_s, b.point AS base_point, b.load AS base_load,
       v.goodput_requests_per_s / nullif(b.goodput_requests_per_s, 0) AS goodput_ratio,
       coalesce(pv.host_bound, false) OR coalesce(pb.host_bound, false) AS host_bound
FROM best v
JOIN run_variants rv ON rv.run_id = v.run_id AND rv.variant_uid = v.variant_uid AND rv.role = 'variant'
LEFT JOIN run_variants rb ON rb.run_id = v.run_id AND rb.role = 'base'
LEFT JOIN best b ON b.run_id = v.run_id AND b.variant_uid = rb.variant_uid AND b.engine = v.engine
                AND b.scenario = v.scenario
LEFT JOIN paced pv ON pv.run_id = v.run_id AND pv.variant_uid = v.variant_uid
LEFT JOIN paced pb ON pb.run_id = v.run_id AND pb.variant_uid = rb.variant_uid;
