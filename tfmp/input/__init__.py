"""What every tfmp input pipeline shares (classification and detection alike).

* `spec`       dataset spec strings (``kind`` or ``kind:argument``), image-size and batch checks
* `source`     `Source`: one split as a cheap example stream plus its decoder
* `sharding`   shard policy, the shuffled/sharded/skipped example stream, eval padding to full
               batches, the final dataset options
* `tfds_reader` prepared TFDS datasets: builder errors, reading still-encoded records

The tasks' data modules (`tfmp.classification.data`, `tfmp.detection.data`) build on these.
"""
