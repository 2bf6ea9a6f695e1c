-- Speed rows shared between checkpoints of one format. run_variants.speed_variant_uid is the checkpoint whose
-- rows a run uses for the variant: itself (NULL), or another of the same format (the same config, quantization
-- layout and tensor shapes: the same kernels on the same shapes), measured in this run or an earlier one.
ALTER TABLE run_variants ADD COLUMN speed_variant_uid VARCHAR;
