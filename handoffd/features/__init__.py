"""Features: each installs itself into an Engine through the core's hooks (dependencies,
orchestration and aggregation, cancellation, contracts, artifacts, context, trace);
:func:`handoffd.features.build.build_engine` assembles them."""
