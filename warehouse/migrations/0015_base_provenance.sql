-- Base provenance: whether a model's weights passed through quantization before quantgate got them (a GGUF file's
-- quant type, a checkpoint's quantization_config, bitsandbytes; tasks/adapters/provenance.py). `prequantized` says
-- whether they did, `provenance` is how verdicts name it ('Q4_K_M GGUF', '8-bit fp8 (quantization_config)'; also
-- 'F32 GGUF', not quantized) and `provenance_detail` is catalog/records.Provenance as JSON. NULL: not recorded.
ALTER TABLE models ADD COLUMN prequantized BOOLEAN;
ALTER TABLE models ADD COLUMN provenance VARCHAR;
ALTER TABLE models ADD COLUMN provenance_detail JSON;
-- A GGUF base stored before is known here by its converted folder's name, <file stem>-<sha12>, which by llama.cpp's
-- convention ends in the quant type (qwen2.5-coder-1.5b-instruct-q4_k_m): that is its provenance. A GGUF named
-- without one and every other model stored before stay NULL until a run records them (store.record_model fills a
-- row it finds without).
UPDATE models
SET provenance = upper(regexp_extract(regexp_replace(path, '^.*/|-[0-9a-f]{12}$', '', 'g'),
                                      '(^|[^A-Za-z0-9])(I?Q[1-8](_[A-Za-z0-9]{1,4}){0,2}|TQ[12]_0|BF16|F16|F32)($|[^A-Za-z0-9])',
                                      2, 'i'))
WHERE source = 'gguf';
UPDATE models SET provenance = NULL WHERE provenance = '';
UPDATE models
SET prequantized = provenance NOT IN ('F32', 'F16', 'BF16'),
    provenance_detail = json_object('quantized', provenance NOT IN ('F32', 'F16', 'BF16'), 'via', 'gguf',
                                    'quant_type', provenance,
                                    'bits', TRY_CAST(regexp_extract(provenance, '[0-9]+') AS INTEGER),
                                    'evidence', 'file name (stored before migration 0015)'),
    provenance = provenance || ' GGUF'
WHERE source = 'gguf' AND provenance IS NOT NULL;
