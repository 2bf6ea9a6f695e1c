"""warehouse-maintenance: DuckLake's upkeep on a schedule (inlined rows flushed to Parquet, small files merged,
snapshots older than `keep_days` expired and their files deleted), as `quantgate warehouse maintain` does."""

from __future__ import annotations

from prefect import flow, get_run_logger

from quantgate.warehouse import sessions


@flow(name="warehouse-maintenance")
def maintain_warehouse(warehouse: str | None = None, keep_days: int = 7) -> list[dict[str, float | str]]:
    """Run each maintenance step, holding the warehouse's write lock; readers go on reading meanwhile."""
    done = sessions.maintain(warehouse, keep_days)
    for step, seconds in done:
        get_run_logger().info("%s: %.1f s", step, seconds)
    return [{"step": step, "seconds": seconds} for step, seconds in done]
