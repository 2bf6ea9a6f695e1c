-- Long-context retrieval of each variant beside its base in the same run, gated or not: exact match on a
-- fact planted at several depths of a long document (qg_passkey, or any copy of it named qg_passkey*).
-- 4-bit variants are known to lose far more on long inputs than on short ones. With several such tasks
-- the one with the lowest recovery is shown.
CREATE OR REPLACE VIEW variant_long_context AS
SELECT run_id, variant_uid, task AS long_context_task, filter AS long_context_filter,
       variant_value AS long_context, base_value AS long_context_base, recovery AS long_context_recovery,
       n_samples AS long_context_items
FROM variant_recovery
WHERE task LIKE 'qg_passkey%' AND metric = 'exact_match'
QUALIFY row_number() OVER (PARTITION BY run_id, variant_uid ORDER BY recovery ASC NULLS LAST, task, filter) = 1;
