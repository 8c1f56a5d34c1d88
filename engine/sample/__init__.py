"""From logits to tokens: the sampler, the logits transforms, prompt logprobs."""
