"""Stage `ingest`: instance images + captions -> a validated, normalised imagefolder."""
