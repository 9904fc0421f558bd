// Hugging Face tokenizer files written from a GGUF file's tokenizer, so that a client that loads its tokenizer by
// name (transformers' AutoTokenizer, and so tinker-cookbook) can tokenize offline as rlloop does on a GGUF base.
#pragma once
#include <string>

namespace rlloop {

// Writes tokenizer.json and tokenizer_config.json into `dir` (made when absent) from the tokenizer in the GGUF
// file `gguf_path`'s metadata: byte-level BPE (tokenizer.ggml.model "gpt2") with its pre-tokenizer as
// tokenizer.json spells it, its vocabulary, merges and added tokens (control tokens special), and its eos/bos tokens
// and chat template (tokenizer.chat_template) in tokenizer_config.json. The files tokenize as the GGUF tokenizer
// does (load_tokenizer reads them back; transformers' tokenizers library runs them). unsupported for a SentencePiece
// ("llama") or another tokenizer model, or a pre-tokenizer rlloop does not implement; io_error when `dir` cannot be
// written.
void write_hf_tokenizer(const std::string& gguf_path, const std::string& dir);

}  // namespace rlloop
