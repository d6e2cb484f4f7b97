"""The ground floor every stage stands on: the domain model, the error tree, logging, settings parsed once
(`config`), bounded file reads, validation of what is sent, metrics, and the shipped data tables (the Xid
catalog, the health signals) with their loaders. Imports nothing else of gpuguard."""
