"""The vocabulary every layer shares: sequence layouts and shards (``layout``), mask classes
(``masks``), the fp32 merge of partials (``merge``) and the schedule data types
(``schedule``). Pure: no process groups."""
