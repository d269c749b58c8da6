"""The stages' computations, one module per stage (mirroring `assets/`), from arrays to Arrow tables.

    activations -> local_fits -> residuals -> geometry, controls, functional_metrics

The Dagster assets and the convention sweep stream blocks of sequences through these (the runners
`stream_fits`, `stream_geometry`, `stream_functional`); `updatelens.analysis` runs them on one layer
in memory (notebooks, tests). Nothing here imports Dagster or knows where tables are
stored. What each stage's module imports from the engine is that stage's code version
(`updatelens.versions`).
"""
