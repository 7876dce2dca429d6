"""The commands a job runs (train, bench, tune, eval, plan, sync): each composes the rooms below it
from the validated config, with the pre-flight checks, params and tracking run they share."""
