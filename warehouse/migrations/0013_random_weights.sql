-- A run on a model's shape (a `shape` source): the checkpoint holds random weights of the model's published (or a
-- local) config, so its speed, memory and time are the model's and its quality is not measured. Every model stored
-- before is a real checkpoint. (DuckLake refuses `DEFAULT false` on an added column; readers coalesce a NULL, as a
-- Parquet export of an older schema loads one, to false.)
ALTER TABLE models ADD COLUMN random_weights BOOLEAN;
UPDATE models SET random_weights = false;
