//! Greedy output equals llama.cpp's, token for token, on the shared models of every
//! architecture: `data/llama-cpp-greedy.json` holds llama.cpp's greedy continuations of fixed
//! prompts (written by `data/make_llama_cpp_greedy.py` with llama.cpp commit 34af94cd).

mod common;

use common::*;

#[derive(serde::Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    model: String,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn reference() -> Reference {
    let text = include_str!("data/llama-cpp-greedy.json");
    serde_json::from_str(text).expect("llama-cpp-greedy.json")
}

#[test]
fn greedy_continuations_equal_llama_cpp_on_every_architecture() {
    let reference = reference();
    let mut architectures = std::collections::BTreeSet::new();
    for case in &reference.cases {
        let path = models_dir().join("..").join(&case.model);
        let mut backend = open(&path, 2, 128);
        architectures.insert(backend.info().architecture.to_string());
        let ours = greedy(&mut backend, &case.prompt, case.greedy.len());
        assert_eq!(
            ours, case.greedy,
            "{}: prompt {:?}: Specula's greedy continuation differs from llama.cpp's",
            case.model, case.prompt
        );
    }
    assert_eq!(
        architectures.into_iter().collect::<Vec<_>>(),
        ["llama", "qwen2", "qwen35", "qwen3next"]
    );
}
