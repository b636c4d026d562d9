"""Media: a row's references fetched under the URL policy, images decoded, video frames sampled."""
