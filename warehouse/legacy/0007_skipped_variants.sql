-- A variant may be skipped: not built because its backend cannot run on the machine that ran the flow
-- (bitsandbytes not installed, or without a backend for the device). DuckDB cannot change the CHECK on
-- variants.status, so such a row keeps status 'failed' with skipped = true and the reason in error;
-- variant_scorecard shows its build_status as 'skipped'.
ALTER TABLE variants ADD COLUMN skipped BOOLEAN DEFAULT false;
