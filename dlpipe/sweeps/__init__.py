"""A --multirun sweep's reporting: the parent MLflow run (a Hydra callback), its jobs side by side as
a table and a chart, and advice withdrawn where another job of the sweep ran no faster."""
