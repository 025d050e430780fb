"""The per-node sidecar: supervises the roles of a job on its node."""
