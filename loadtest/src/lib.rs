//! faden-loadtest: the OpenAI-aware load generator (filled in by the loadtest issue).
