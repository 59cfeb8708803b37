// Command otelcol is the tests' OpenTelemetry Collector: the upstream OTLP receiver in, the
// upstream file exporter (OTLP JSON lines) out; what the collector builder (ocb) generates for
// those two components, written out.
package main

import (
	"log"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry"
)

func components() (otelcol.Factories, error) {
	var err error
	// No telemetry of its own (no logs, metrics or traces about itself): nothing to configure.
	f := otelcol.Factories{Telemetry: telemetry.NewFactory(func() component.Config { return &struct{}{} })}
	f.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory())
	if err != nil {
		return f, err
	}
	f.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](fileexporter.NewFactory())
	return f, err
}

func main() {
	info := component.BuildInfo{Command: "otelcol-test", Description: "test collector", Version: "0"}
	settings := otelcol.CollectorSettings{
		BuildInfo: info,
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{fileprovider.NewFactory()},
				DefaultScheme:     "file", // no ${env:...} in the tests' config: no env provider
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		log.Fatal(err)
	}
}
