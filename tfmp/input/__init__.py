"""What every tfmp input pipeline shares (classification and detection alike).

* `spec`       dataset spec strings (``kind`` or ``kind:argument``), image-size and batch checks
* `source`     `Source`: one split as a cheap example stream plus its decoder
* `stream`     shard policy, the shuffled/sharded/skipped example stream, eval padding to full
               batches, the final dataset options
* `tfds_reader` prepared TFDS datasets: builder errors, reading still-encoded records, the
               "is it prepared" check
* `image_files` image files sniffed (first and last bytes, the size their header declares)
               before a run starts: a bad or oversized file is one error line naming it;
               decoding resized from 8-bit pixels
* `decoding`   image files decoded one way by every reader and by that check (to the model's
               channels, WebP included), names that are not UTF-8, and the file a run's
               decode error came from
* `randaugment` RandAugment's image ops on one image, keyed by a stateless random key
* `mixing`     Mixup and CutMix of a batch (soft labels, label smoothing, sample weights)

The tasks' data modules (`tfmp.classification.data`, `tfmp.detection.data`) build on these.
"""
