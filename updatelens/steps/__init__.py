"""The stages' computations, one module per stage (mirroring `assets/`), from arrays to Arrow tables.

    activations -> local_fits -> residuals -> geometry, controls, functional_metrics

The Dagster assets stream blocks of sequences through these; `updatelens.analysis` runs them on one
layer in memory (notebooks, sweeps, tests). Nothing here imports Dagster or knows where tables are
stored. What each stage's module imports from the engine is that stage's code version
(`updatelens.versions`).
"""
