"""Reports: figures and HTML built from the catalog (no recomputation)."""
