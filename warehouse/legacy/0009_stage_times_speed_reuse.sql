-- Where a run's time went, and speed rows a rerun reuses.
-- run_stages: when each stage item began (completed_at is when it ended) and how many engine starts it made
-- (an engine session, an lm-eval model load, a `vllm serve` per sweep point; 0 for what it reused).
-- run_variants: the hash of what the variant's speed depends on (its scenarios, the libraries, the device), and
-- the run whose speed rows this run uses for it: itself, or an earlier run that measured the same key.
ALTER TABLE run_stages ADD COLUMN started_at TIMESTAMP;
ALTER TABLE run_stages ADD COLUMN engine_starts INTEGER;
ALTER TABLE run_variants ADD COLUMN speed_key VARCHAR;
ALTER TABLE run_variants ADD COLUMN speed_run_id VARCHAR;
