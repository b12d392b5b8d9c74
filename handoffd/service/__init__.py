"""Running the engine: the daemon (scheduling, workers, leases), the sweeper (recovery), listing
and waiting for the CLI and the library."""
