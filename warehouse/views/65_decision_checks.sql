-- What each decision rested on, from its rows in decision_checks (decisions written before migration 0009
-- have none: their verdict and reason still show, these views just have no row for them).

-- The check that made the verdict: the first that made it not comparable (a base outside its published figure, a
-- variant anomalously above its base), else the first that failed, else the first inconclusive; none for an accept.
CREATE OR REPLACE VIEW deciding_check AS
SELECT run_id, variant_uid, position, kind, name, outcome, value, lower, upper, threshold, items, items_to_decide, note
FROM decision_checks
WHERE outcome IN ('not_comparable', 'anomalous', 'fail', 'inconclusive')
QUALIFY row_number() OVER (PARTITION BY run_id, variant_uid
                           ORDER BY CASE outcome WHEN 'fail' THEN 1 WHEN 'inconclusive' THEN 2 ELSE 0 END, position) = 1;

-- The least powered quality gate of a decision: the largest recovery drop its items could not resolve.
CREATE OR REPLACE VIEW decision_power AS
SELECT run_id, variant_uid, max(min_detectable_drop) AS min_detectable_drop,
       arg_max(name, min_detectable_drop) AS power_basis
FROM decision_checks
WHERE kind = 'quality' AND min_detectable_drop IS NOT NULL
GROUP BY run_id, variant_uid;

-- The decision's serving check: goodput at the SLO over the base's, and the tuned serving config it was judged on.
CREATE OR REPLACE VIEW decision_serving AS
SELECT run_id, variant_uid, value AS serving_goodput_ratio, json_extract_string(detail, '$.point') AS serving_config
FROM decision_checks
WHERE kind = 'serving' AND json_extract_string(detail, '$.point') IS NOT NULL;
