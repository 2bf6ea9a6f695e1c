-- Decisions rest on a confidence interval of recovery, not on its point estimate alone.
ALTER TABLE decisions ADD COLUMN quality_lower_bound DOUBLE;  -- worst CI lower bound of recovery over the gated metrics
ALTER TABLE decisions ADD COLUMN flip_rate DOUBLE;            -- highest share of items flipped (right ↔ wrong) over the gated metrics
