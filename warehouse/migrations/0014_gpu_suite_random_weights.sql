-- The GPU suite's models (its builds are dummy weights of a real shape: variants.weights = 'dummy') hold random
-- weights as a shape run's do, but 0013 marked every model stored before it a real checkpoint, these too. A model's
-- row is written once (by its uid, the shape's config hash), so a later suite run of the same shape would not mend it.
UPDATE models SET random_weights = true
WHERE model_uid IN (SELECT model_uid FROM variants WHERE weights = 'dummy');
