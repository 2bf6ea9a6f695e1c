-- Which version of the views (warehouse/views/*.sql) the warehouse holds, by checksum: a writable
-- connection recreates the views only when their SQL changed or a migration ran, not on every open.
CREATE TABLE schema_views (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    checksum VARCHAR NOT NULL,
    applied_at TIMESTAMP NOT NULL
);
