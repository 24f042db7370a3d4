//! A `Stagehand` handle served and exported from its builder in one call each: the server starts
//! when the handle is built, shows the run the handle trains (API and `/metrics`), and stops with
//! the handle; OTLP stays off without `OTEL_*` variables.

use stagehand::device::Device;
use stagehand::nn as snn;
use stagehand_web::{Observe, ServerConfig};
use std::sync::mpsc;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

fn get(url: &str) -> String {
    ureq::get(url).call().expect("answers").into_string().expect("text")
}

#[test]
fn the_builder_serves_and_exports_the_run_it_trains() {
    stagehand::torch::init();
    let budget = 64 << 20;
    let (tx, rx) = mpsc::channel();
    let sh = stagehand::Stagehand::builder()
        .budget_bytes(budget)
        .device(Device::host(budget))
        .serve(ServerConfig::new("127.0.0.1:0"), move |s| tx.send(s.url()).expect("sends the address"))
        .otlp_from_env()
        .build()
        .expect("handle");
    let url = rx.recv().expect("the server started with the handle");
    let r = sh.root();
    let l1 = snn::linear(&r / "blocks" / 0 / "fc", 16, 16, Default::default());
    let l2 = snn::linear(&r / "blocks" / 1 / "fc", 16, 1, Default::default());
    drop(r);
    let mut opt = sh.optimizer(nn::Sgd::default(), 0.1).expect("optimizer");
    for step in 0..3 {
        let x = Tensor::ones([4, 16], (Kind::Float, tch::Device::Cpu)) * (step + 1) as f64;
        sh.train_step(&mut opt, || l2.forward(&l1.forward(&x)).mean(Kind::Float)).expect("step");
    }
    sh.finish().expect("finish");
    // Everything the run published has reached the hub the server reads.
    sh.bus().flush();
    let snapshot: serde_json::Value = serde_json::from_str(&get(&format!("{url}/api/snapshot"))).expect("json");
    assert_eq!(snapshot["step"], 3, "the served snapshot follows the handle's run");
    let metrics = get(&format!("{url}/metrics"));
    assert!(metrics.lines().any(|l| l.starts_with("stagehand_step{") && l.ends_with(" 3")), "{metrics}");
    drop(sh);
    assert!(ureq::get(&format!("{url}/api/snapshot")).call().is_err(), "the server stops with the handle");
}
